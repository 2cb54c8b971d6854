"""Strategy construction: one `MirroredStrategy` per device set, one
`MultiWorkerMirroredStrategy` per process, cached.

Below `devices` and `_multi_worker` (whose `init` builds the worker's
strategy here); imports neither.
"""

import threading

import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors

_STRATEGIES = {}
_STRATEGIES_LOCK = threading.Lock()


def multi_worker_device():
    """The `tf.DeviceSpec` of this worker's strategy (job, task), or None."""
    for key, strategy in list(_STRATEGIES.items()):
        if key[0] == "multi_worker":
            return tf.DeviceSpec.from_string(_compat.worker_device(strategy))
    return None


def default_cross_device_ops(devices):
    """Picks the all-reduce implementation for a one-host strategy.

    On GPUs, TensorFlow's own choice (NCCL all-reduce where available). On
    CPU devices, `ReductionToOneDevice`, which measured about twice as fast
    as the default collective ring on logical CPUs.
    """
    if all("GPU" in d.upper() for d in devices):
        return None
    return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])


def single_host_cross_device_ops(devices, communication="auto"):
    """The all-reduce of a one-host MirroredStrategy for `communication`.

    `"auto"`: `default_cross_device_ops`. `"nccl"`: `NcclAllReduce`, GPUs
    only. `"ring"` names the ring algorithm of TensorFlow's collective ops,
    which only `MultiWorkerMirroredStrategy` uses: refused on one host.
    """
    if communication == "auto":
        return default_cross_device_ops(devices)
    if communication == "nccl":
        if not all("GPU" in d.upper() for d in devices):
            raise ValueError(
                "`communication='nccl'` needs GPU devices (NCCL is NVIDIA's "
                "GPU library). Received: communication='nccl' with "
                f"devices={list(devices)}")
        return tf.distribute.NcclAllReduce()
    raise ValueError(
        f"`communication={communication!r}` selects an implementation of "
        "TensorFlow's collective ops, which only a multi-worker cluster "
        "uses; on one host use 'auto' (NCCL on GPUs) or 'nccl'. "
        f"Received: communication={communication!r}")


def mirrored_strategy(devices, communication="auto"):
    """Returns the process-wide MirroredStrategy for `devices`.

    Strategies are cached: two MirroredStrategy objects over the same devices
    in one process can collide on collective instance keys.
    """
    key = (tuple(devices), communication)
    with _STRATEGIES_LOCK:
        if key not in _STRATEGIES:
            ops = single_host_cross_device_ops(devices, communication)
            _STRATEGIES[key] = tf.distribute.MirroredStrategy(
                devices=list(devices), cross_device_ops=ops
            )
        return _STRATEGIES[key]


def _local_index(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type.upper(), spec.device_index


def multi_worker_strategy(spec, devices, communication_options=None):
    """Returns the process-wide MultiWorkerMirroredStrategy for a cluster.

    Args:
        spec: `keras_mirror.cluster.ClusterSpec` of two or more tasks.
        devices: list of str. This worker's own local devices (all of one
            type); the worker hosts one replica per device.
        communication_options: `tf.distribute.experimental.
            CommunicationOptions` or None: the strategy's defaults for every
            collective (implementation, packing, `timeout_seconds`).

    TensorFlow's `MultiWorkerMirroredStrategy` puts one replica on `CPU:0`
    of each worker when it has no GPU, and on every GPU otherwise; it takes
    no device list. keras-mirror overrides its local-device discovery (a
    private hook, kept in `_compat.collective_extended_on`) so that a
    worker's replicas are exactly `devices` (e.g. 2 logical CPUs per worker
    for development). Building the strategy starts this
    worker's gRPC server and waits until every peer has joined. One
    strategy is cached per process: a second one would collide on
    collective keys and cannot restart the server.
    """
    kinds = {_local_index(d)[0] for d in devices}
    if len(kinds) != 1:
        raise errors.DeviceError(
            "A multi-worker replica set must use devices of one type. "
            f"Received: devices={list(devices)!r}")
    kind = kinds.pop()
    indices = [_local_index(d)[1] for d in devices]
    comm = communication_options or \
        tf.distribute.experimental.CommunicationOptions()
    key = ("multi_worker", spec)
    with _STRATEGIES_LOCK:
        for k, strategy in _STRATEGIES.items():
            if k[0] == "multi_worker" and k != key:
                raise errors.DeviceError(
                    "This process already runs a multi-worker strategy for "
                    "another cluster; TensorFlow supports one per process. "
                    f"Received: cluster={spec!r}")
        if key in _STRATEGIES:
            strategy = _STRATEGIES[key]
            want = tuple(f"{kind}:{i}" for i in indices)
            have = tuple("{}:{}".format(*_local_index(d))
                         for d in strategy.extended.worker_devices)
            if want != have:
                raise errors.DeviceError(
                    "This process's multi-worker strategy was built over "
                    f"{list(have)}; TensorFlow supports one per process. "
                    f"Received: devices={list(devices)!r}")
            return strategy

        extended = _compat.collective_extended_on(kind, indices)

        class _Strategy(tf.distribute.MultiWorkerMirroredStrategy):
            def __init__(self, resolver, options):
                tf.distribute.Strategy.__init__(
                    self, extended(self, cluster_resolver=resolver,
                                   communication_options=options))

        jobs = {"worker": list(spec.workers)}
        if spec.chief is not None:
            jobs["chief"] = [spec.chief]
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), task_type=spec.task_type,
            task_id=spec.task_index, rpc_layer="grpc")
        try:
            strategy = _Strategy(resolver, comm)
        except RuntimeError as e:
            if "program startup" not in str(e):
                raise
            raise errors.DevicesAlreadyInitializedError(
                "A multi-worker strategy must be built before TensorFlow "
                "initialises its devices (building a model or listing "
                "devices does). Put `import keras_mirror` at the top of "
                "your script (it builds the strategy when `TF_CONFIG` or "
                "Slurm names a cluster), or call `keras_mirror.init("
                "cluster)` first thing when you pass `cluster=` yourself. "
                f"Received: cluster={spec!r}") from None
        _STRATEGIES[key] = strategy
        return strategy
