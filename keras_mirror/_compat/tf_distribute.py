"""TensorFlow's distribute strategies and tf.data sharding."""

import keras  # noqa: F401

from keras_mirror._compat._base import _missing  # noqa: F401
from keras_mirror._compat._base import _require

# -- tf.distribute's multi-worker strategy (keras_mirror.devices) ------------

# `MultiWorkerMirroredStrategy` takes no device list: it puts one replica on
# `CPU:0` of a worker without GPUs, and one on every GPU otherwise. To give a
# worker exactly the devices asked for (2 logical CPUs per worker for
# development and CI, or a subset of its GPUs), keras-mirror subclasses the
# strategy's extended class and overrides its local-device discovery, which
# `__init__` calls with the worker's device prefix
# (`/job:worker/task:i`) and which returns `(devices, device_type)`.
_TF_COLLECTIVE_MODULE = (
    "tensorflow.python.distribute.collective_all_reduce_strategy")
_TF_COLLECTIVE_EXTENDED = "CollectiveAllReduceExtended"
_TF_LOCAL_DEVICES_HOOK = "_initialize_local_devices"
# The same prefix, kept by the extended strategy: it tells which of the
# logical devices TensorFlow lists (every worker's, once a cluster is up) are
# this process's own.
_TF_WORKER_DEVICE = "_worker_device"


def _collective_extended_base():
    import importlib

    module = importlib.import_module(_TF_COLLECTIVE_MODULE)
    base = getattr(module, _TF_COLLECTIVE_EXTENDED, None)
    if base is None or not hasattr(base, _TF_LOCAL_DEVICES_HOOK):
        import tensorflow as tf

        raise RuntimeError(
            f"This TensorFlow release ({tf.__version__}) has no "
            f"`{_TF_COLLECTIVE_EXTENDED}.{_TF_LOCAL_DEVICES_HOOK}`; "
            "keras-mirror cannot choose a worker's devices for "
            "MultiWorkerMirroredStrategy. Install a supported TensorFlow "
            "(see keras_mirror._compat).")
    return base


def collective_extended_on(device_type, indices):
    """A `CollectiveAllReduceExtended` whose replicas are the given devices.

    The worker's replicas are `<worker>/device:<device_type>:<i>` for each
    `i` in `indices`, in that order.
    """
    indices = tuple(indices)

    def local_devices(self, cluster_resolver, worker_device):
        del cluster_resolver  # the devices are given
        return tuple(f"{worker_device}/device:{device_type}:{i}"
                     for i in indices), device_type

    return type("CollectiveAllReduceExtendedOnDevices",
                (_collective_extended_base(),),
                {_TF_LOCAL_DEVICES_HOOK: local_devices})


def worker_device(strategy):
    """The worker device prefix (`/job:worker/task:i`) of `strategy`."""
    return getattr(strategy.extended, _TF_WORKER_DEVICE)


# -- virtual shards of a tf.data pipeline (distribute/_virtual_shards.py) ---

# TensorFlow shards a pipeline by its files only inside
# `experimental_distribute_dataset`, for the strategy's workers. A virtual
# shard is one such shard for a fixed count `V`, whatever the number of
# workers: `_AutoShardDataset(dataset, V, v)` applies the same graph rewrite
# (files `v, v + V, ...`, or a `SHARD_HINT`), with the policy in the
# dataset's options. The pipeline's graph (`_as_serialized_graph`) says which
# files it reads, its batch size and whether a `shuffle` has a seed.
_AUTO_SHARD_MODULE = "tensorflow.python.data.experimental.ops.distribute"
_AUTO_SHARD = "_AutoShardDataset"
_DATASET_GRAPH = "_as_serialized_graph"


def auto_shard(dataset, num_shards, index):
    """`dataset`'s shard `index` of `num_shards`, as TF's auto-sharding."""
    import importlib

    module = importlib.import_module(_AUTO_SHARD_MODULE)
    _require(module, (_AUTO_SHARD,), _AUTO_SHARD_MODULE,
             "shard a tf.data pipeline into virtual shards")
    return getattr(module, _AUTO_SHARD)(dataset, num_shards, index)


def dataset_graph(dataset):
    """The `GraphDef` of a `tf.data.Dataset`'s pipeline."""
    from tensorflow.core.framework import graph_pb2

    _require(dataset, (_DATASET_GRAPH,), "tf.data.Dataset",
             "read a tf.data pipeline's files and batch size")
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(getattr(dataset, _DATASET_GRAPH)().numpy())
    return graph


# A `.shard(SHARD_HINT, SHARD_HINT)` is read only by TensorFlow's
# auto-sharding (a virtual shard's `_AutoShardDataset`); anywhere else the
# pipeline fails at its first read, and reports 0 batches. A dataset's input
# datasets are its `_inputs()`; a shard's counts are `_num_shards` and
# `_index` (tensors, -1 for the hint).
_DATASET_INPUTS = "_inputs"
_SHARD_COUNTS = ("_num_shards", "_index")


def has_shard_hint(dataset):
    """Whether `dataset` or an input of it (not those inside its functions)
    is a `shard(SHARD_HINT, SHARD_HINT)`."""
    if not hasattr(dataset, _DATASET_INPUTS):
        raise _missing(f"tf.data.Dataset.{_DATASET_INPUTS}",
                       "find a SHARD_HINT outside virtual shards")
    todo, seen = [dataset], set()
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        shards, index = (getattr(d, name, None) for name in _SHARD_COUNTS)
        if shards is not None and index is not None and \
                int(shards) == -1 and int(index) == -1:
            return True
        todo.extend(getattr(d, _DATASET_INPUTS)())
    return False
