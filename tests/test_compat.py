"""One test per private Keras attribute in `keras_mirror/_compat.py`.

A Keras release that renames or changes one of them fails here, by name,
instead of silently mis-weighting gradients elsewhere.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror import _compat


def _dense_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_supported_keras_version():
    _compat.check_keras_version()


def test_optimizer_allreduce_hook_exists_and_is_used():
    opt = keras.optimizers.SGD(1.0)
    assert callable(getattr(opt, _compat._ALLREDUCE_HOOK))
    var = keras.Variable(np.zeros(2, "float32"))
    seen = []

    def make_hook(original):
        def hook(grads_and_vars):
            seen.append(len(list(grads_and_vars)))
            return [(g * 2.0, v) for g, v in grads_and_vars]
        return hook

    _compat.replace_optimizer_allreduce(opt, make_hook)
    opt.apply([tf.ones(2)], [var])
    assert seen == [1]
    np.testing.assert_allclose(var.numpy(), [-2.0, -2.0])


def test_disable_optimizer_allreduce():
    opt = keras.optimizers.SGD(1.0)
    _compat.disable_optimizer_allreduce(opt)
    pairs = [(tf.ones(1), None)]
    assert getattr(opt, _compat._ALLREDUCE_HOOK)(pairs) == pairs


def test_loss_tracker_is_the_loss_mean():
    model = _dense_model()
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    assert tracker.name == "loss"
    assert _compat.loss_tracker(keras.Sequential()) is None


def test_loss_scalers_exist_and_divide_by_replicas(cpus):
    module = _compat._loss_module()
    for name in _compat._LOSS_SCALERS:
        assert callable(getattr(module, name))
    strategy = tf.distribute.MirroredStrategy(cpus[:2])
    loss = keras.losses.MeanSquaredError()
    y = tf.ones((2, 1))

    def step():
        return loss(y, tf.zeros((2, 1)))

    scaled = strategy.experimental_local_results(strategy.run(step))[0]
    with _compat.unscaled_losses():
        plain = strategy.experimental_local_results(strategy.run(step))[0]
    assert float(scaled) == pytest.approx(0.5)
    assert float(plain) == pytest.approx(1.0)
    # Restored afterwards.
    again = strategy.experimental_local_results(strategy.run(step))[0]
    assert float(again) == pytest.approx(0.5)


def test_symbolic_build_exists():
    assert callable(getattr(keras.Model, _compat._SYMBOLIC_BUILD))


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


def test_masks_are_read_and_set_on_tensors_and_reach_losses():
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(
        tf.constant([[1, 0, 2]]))
    np.testing.assert_array_equal(_compat.get_mask(embedded),
                                  [[True, False, True]])
    assert _compat.get_mask(tf.zeros((1, 3))) is None
    # A mask set by `set_mask` is the one Keras's losses divide by.
    y_pred = tf.constant([[[1.0], [5.0], [3.0]]])
    _compat.set_mask(y_pred, tf.constant([[True, False, True]]))
    assert _compat.get_mask(y_pred) is not None
    value = keras.losses.MeanSquaredError()(tf.zeros((1, 3, 1)), y_pred)
    # Unmasked entries only: (1 + 9) / 2.
    assert float(value) == pytest.approx(5.0)


# -- attributes added for wrapping in place and exact randomness -----------


def test_variable_backing_can_be_replaced_and_restored(cpus):
    v = keras.Variable(np.arange(3, dtype="float32"))
    plain = _compat.backing(v)
    assert isinstance(plain, tf.Variable)
    strategy = tf.distribute.MirroredStrategy(cpus[:2])
    with strategy.scope():
        mirrored = _compat.new_backing(v, plain.read_value())
    assert _compat.backing(v) is plain  # not installed by new_backing
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    _compat.set_backing(v, mirrored)
    np.testing.assert_array_equal(v.numpy(), [0, 1, 2])
    _compat.set_backing(v, plain)
    assert _compat.backing(v) is plain


def test_random_module_has_the_replaced_functions():
    module = _compat.random_module()
    for name in _compat.RANDOM_FUNCTIONS + ("_cast_seed", "draw_seed"):
        assert callable(getattr(module, name))
    # keras.random reaches them through the module at call time.
    calls = []
    original = module.normal

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    with _compat.replaced(module, {"normal": spy}):
        keras.random.normal((2,), seed=1)
    assert len(calls) == 1
    assert module.normal is original


def test_output_loss_trackers_and_compiled_checks():
    a = keras.Input((2,))
    model = keras.Model(a, [keras.layers.Dense(1, name="p")(a),
                            keras.layers.Dense(1, name="q")(a)])
    assert not _compat.has_compiled_loss_or_metrics(model)
    model.compile("sgd", ["mse", "mse"])
    assert _compat.has_compiled_loss_or_metrics(model)
    model.fit(np.zeros((2, 2)), [np.zeros((2, 1))] * 2, verbose=0)
    trackers = _compat.output_loss_trackers(model)
    assert [t.name for t in trackers] == ["p_loss", "q_loss"]
    assert all(isinstance(t, keras.metrics.Mean) for t in trackers)


def test_flat_losses_report_each_outputs_value():
    a = keras.Input((2,))
    model = keras.Model(a, [keras.layers.Dense(1, name="p")(a),
                            keras.layers.Dense(1, name="q")(a)])
    assert _compat.flat_losses(model) is None
    model.compile("sgd", ["mse", keras.losses.MeanAbsoluteError(
        reduction="sum")], loss_weights=[1.0, 0.5])
    model.fit(np.zeros((2, 2)), [np.ones((2, 1))] * 2, verbose=0)
    entries = _compat.flat_losses(model)
    assert [e.name for e in entries] == ["p", "q"]
    assert [e.loss_weights for e in entries] == [1.0, 0.5]
    seen = []
    x = np.ones((3, 2), "float32")
    y_pred = model(x)
    with _compat.reporting_flat_losses(model, lambda i, v: seen.append(i)):
        total = model.compute_loss(x=x, y=[np.ones((3, 1))] * 2,
                                   y_pred=y_pred)
    assert seen == [0, 1]
    assert _compat.flat_losses(model) is entries  # restored
    assert float(total) > 0


def test_keras_per_sample_loss_knows_the_builtins():
    def own(y_true, y_pred):
        return keras.ops.sum(y_pred)

    class Own(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return y_pred

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0)
    assert _compat.keras_per_sample_loss(_compat.flat_losses(model)[0].loss)
    assert _compat.keras_per_sample_loss(
        keras.losses.MeanSquaredError(reduction="sum"))
    assert not _compat.keras_per_sample_loss(Own())
    model.compile("sgd", own)
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0)
    assert not _compat.keras_per_sample_loss(
        _compat.flat_losses(model)[0].loss)


def test_loss_owners_name_the_add_loss_layers():
    class Adds(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    a = keras.Input((2,))
    model = keras.Model(a, Adds(name="adds")(keras.layers.Dense(2)(a)))
    model(np.ones((1, 2), "float32"))
    assert _compat.loss_owners(model) == ["layer 'adds'"]
    assert len(model.losses) == 1


def test_clip_hook_exists_and_is_used():
    opt = keras.optimizers.SGD(1.0, clipnorm=1.0)
    var = keras.Variable(np.zeros(2, "float32"))
    seen = []

    def make_hook(original):
        def clip(grads):
            seen.append(len(grads))
            return original(grads)
        return clip

    _compat.replace_optimizer_clip(opt, make_hook)
    opt.apply([tf.constant([3.0, 4.0])], [var])
    assert seen == [1]
    np.testing.assert_allclose(var.numpy(), [-0.6, -0.8], rtol=1e-6)


def test_rekey_optimizer_follows_a_new_backing(cpus):
    var = keras.Variable(np.zeros(2, "float32"))
    opt = keras.optimizers.Adam(0.1)
    opt.build([var])
    _compat.set_backing(var, _compat.new_backing(var, tf.ones(2)))
    with pytest.raises(ValueError, match="Unknown variable"):
        opt.apply([tf.ones(2)], [var])
    _compat.rekey_optimizer(opt)
    opt.apply([tf.ones(2)], [var])
    assert int(opt.iterations) == 1
def test_other_backend_is_refused_at_construction(monkeypatch):
    import keras_mirror

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError) as info:
        keras_mirror.MirroredModel(model)
    assert str(info.value) == (
        "keras-mirror needs Keras's TensorFlow backend (it trains on "
        "`tf.distribute`). Set `KERAS_BACKEND=tensorflow` (or "
        '`"backend": "tensorflow"` in ~/.keras/keras.json) before importing '
        "Keras. Received: keras.backend.backend()='jax'")


def test_a_missing_private_name_fails_loudly_by_name():
    with pytest.raises(RuntimeError, match=r"has no `Variable\._value`; "
                       r"keras-mirror cannot move it\. Install a supported "
                       r"Keras"):
        _compat._require(object(), ("_value",), "Variable", "move it")
    opt = keras.optimizers.SGD()
    with pytest.raises(RuntimeError, match=r"SGD\._no_such_hook"):
        _compat._replace_method(opt, "_no_such_hook", lambda f: f, "hook")


def test_moments_module_calls_the_synchronized_moments_by_name():
    import tensorflow as tf

    module = _compat.moments_module()
    calls = []
    original = getattr(module, _compat.SYNC_MOMENTS)

    def spy(x, axes, keepdims):
        calls.append(axes)
        return original(x, axes, keepdims)

    with _compat.replaced(module, {_compat.SYNC_MOMENTS: spy}):
        mean, _ = module.moments(tf.ones((3, 2)), [0], synchronized=True)
    assert calls == [[0]]
    assert mean.numpy().tolist() == [1.0, 1.0]


def test_new_backing_keeps_the_tf_trainable_flag_of_the_current_backing():
    # A layer built trainable, frozen, then unfrozen: its backing stays
    # `trainable=True` (what TensorFlow's tape watches), and so must a new
    # backing made while the layer is frozen.
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    layer.trainable = False
    kernel = layer.kernel
    made = _compat.new_backing(kernel, kernel.numpy())
    assert made.trainable is True
    assert kernel.trainable is False  # the Keras flag is left as it was
    assert _compat.backing(kernel) is not made


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


def test_initial_epoch_is_where_fit_starts():
    # `BackupAndRestore` sets it on the (user's) model; `fit` starts there.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert getattr(model, _compat.INITIAL_EPOCH) is None
    setattr(model, _compat.INITIAL_EPOCH, 2)
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=3,
                        verbose=0)
    assert history.epoch == [2]
