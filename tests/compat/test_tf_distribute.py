"""`keras_mirror/_compat/tf_distribute.py`: one test per private attribute.

Each fails loudly when Keras or TensorFlow renames or removes what it
checks.
"""

import tensorflow as tf

from keras_mirror import _compat


def _collective_base():
    import importlib

    module = importlib.import_module(_compat._TF_COLLECTIVE_MODULE)
    return getattr(module, _compat._TF_COLLECTIVE_EXTENDED)


def test_multi_worker_device_hook_exists_and_is_called():
    import inspect

    base = _collective_base()
    hook = getattr(base, _compat._TF_LOCAL_DEVICES_HOOK)
    assert list(inspect.signature(hook).parameters) == [
        "self", "cluster_resolver", "worker_device"]
    # TensorFlow's constructor asks the hook for the worker's devices.
    source = inspect.getsource(base)
    assert f"self.{_compat._TF_LOCAL_DEVICES_HOOK}(" in source
    extended = _compat.collective_extended_on("CPU", [2, 0])
    assert issubclass(extended, base)
    devices, kind = getattr(extended, _compat._TF_LOCAL_DEVICES_HOOK)(
        None, None, "/job:worker/task:1")
    assert devices == ("/job:worker/task:1/device:CPU:2",
                       "/job:worker/task:1/device:CPU:0")
    assert kind == "CPU"


def test_multi_worker_strategy_keeps_its_worker_device():
    import inspect

    # Set in `CollectiveAllReduceExtended._initialize_multi_worker`; read
    # by `_compat.worker_device` (the multi-worker tests run it for real).
    source = inspect.getsource(_collective_base())
    assert f"self.{_compat._TF_WORKER_DEVICE} = " in source
    fake = type("S", (), {"extended": type(
        "E", (), {_compat._TF_WORKER_DEVICE: "/job:worker/task:3"})()})()
    assert _compat.worker_device(fake) == "/job:worker/task:3"


def test_auto_shard_dataset_reads_files_round_robin(tmp_path):
    files = []
    for i in range(3):
        files.append(str(tmp_path / f"f{i}.tfrecord"))
        with tf.io.TFRecordWriter(files[-1]) as writer:
            for r in range(2):
                writer.write(f"{i}-{r}".encode())
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.FILE)
    ds = tf.data.TFRecordDataset(files).with_options(options)
    shard = _compat.auto_shard(ds, 3, 1)
    assert [r.numpy() for r in shard] == [b"1-0", b"1-1"]


def test_dataset_graph_holds_the_pipeline_ops():
    graph = _compat.dataset_graph(tf.data.Dataset.range(5).batch(2))
    assert {"RangeDataset", "BatchDatasetV2"} <= {n.op for n in graph.node}


def test_a_shard_hint_is_found_through_a_datasets_inputs():
    hint = tf.data.experimental.SHARD_HINT
    base = tf.data.Dataset.range(8)
    for name in (_compat._DATASET_INPUTS,):
        assert hasattr(base, name)
    shard = base.shard(hint, hint)
    assert all(int(getattr(shard, n)) == -1 for n in _compat._SHARD_COUNTS)
    hinted = tf.data.Dataset.zip((base, shard.batch(2).map(lambda v: v)))
    assert _compat.has_shard_hint(hinted.prefetch(1))
    for plain in (base, base.shard(2, 0), base.batch(2).repeat()):
        assert not _compat.has_shard_hint(plain)
