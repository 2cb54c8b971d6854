"""Device discovery, logical CPU devices and strategy construction."""

import threading

import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors

_STRATEGIES = {}
_STRATEGIES_LOCK = threading.Lock()


def logical_cpus(n):
    """Splits the host CPU into `n` logical devices and returns their names.

    TensorFlow fixes its device list the first time it initialises its
    runtime (on the first op, or the first `tf.config.list_logical_devices`
    call), so call this first thing, before building any model. Calling it
    again with the same `n` is a no-op that returns the same names.

    Args:
        n: int. Number of logical CPU devices, at least 1.

    Returns:
        List of the logical CPU device names, e.g.
        `["/job:localhost/replica:0/task:0/device:CPU:0", ...]`.

    Raises:
        ValueError: if `n` is not a positive integer.
        DevicesAlreadyInitializedError: if TensorFlow's devices were already
            initialised with a different number of logical CPUs.

    Example:

    ```python
    import keras_mirror
    keras_mirror.logical_cpus(4)
    ```
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"`n` must be a positive integer. Received: n={n!r}"
        )
    cpu = tf.config.list_physical_devices("CPU")[0]
    configs = [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    try:
        tf.config.set_logical_device_configuration(cpu, configs)
        _start_cluster_from_env(n)
    except RuntimeError:
        current = _local_logical_devices("CPU")
        if len(current) != n:
            _check_worker_cpus(len(current), n)
            raise errors.DevicesAlreadyInitializedError(
                "`logical_cpus(n)` must run before TensorFlow initialises "
                f"its devices; they are already initialised with "
                f"{len(current)} logical CPU device(s). Call "
                "`keras_mirror.logical_cpus` first thing in your program, "
                f"before building any model. Received: n={n!r}"
            ) from None
    return [d.name for d in _local_logical_devices("CPU")]


def _check_worker_cpus(current, n):
    """Names the variable to set when `import keras_mirror` set up a worker."""
    from keras_mirror.distribute import _multi_worker

    if _multi_worker.initialized_devices() is None:
        return
    raise errors.DevicesAlreadyInitializedError(
        "In a multi-worker run, `import keras_mirror` sets up each worker "
        f"(here with {current} logical CPU(s)) before TensorFlow starts, "
        f"so `logical_cpus(n)` comes too late. Set "
        f"`{_multi_worker.CPUS_ENV}={n}` (`keras-mirror launch "
        f"--cpus-per-worker {n}`) and drop the call. Received: n={n!r}")


def _local_logical_devices(kind=None):
    """This process's logical devices (a cluster lists its peers' too)."""
    worker = None
    for key, strategy in list(_STRATEGIES.items()):
        if key[0] == "multi_worker":
            worker = tf.DeviceSpec.from_string(
                _compat.worker_device(strategy))
    found = tf.config.list_logical_devices(kind)
    if worker is None:
        return found
    return [d for d in found
            if tf.DeviceSpec.from_string(d.name).job == worker.job
            and tf.DeviceSpec.from_string(d.name).task == worker.task]


def _canonical(name):
    """Returns the full TF name of a device given in any accepted form."""
    try:
        spec = tf.DeviceSpec.from_string(name)
    except ValueError:
        spec = None
    if spec is None or spec.device_type is None or spec.device_index is None:
        raise errors.DeviceError(
            "Each entry of `devices` must name one device with its type and "
            "index, such as '/gpu:0' or '/cpu:1'. "
            f"Received: devices entry {name!r}"
        )
    spec = spec.replace(device_type=spec.device_type.upper())
    return spec.to_string()


def _check_this_task(name, spec, available, devices):
    """A name with a job or task must be one of this process's devices."""
    if spec.job is None and spec.task is None and spec.replica is None:
        return
    for a in available:
        mine = tf.DeviceSpec.from_string(a)
        if all(getattr(spec, f) in (None, getattr(mine, f))
               for f in ("job", "replica", "task")):
            return
    raise errors.DeviceError(
        f"`devices` names {name!r}, a device of another job or task: "
        "`devices` are this process's own devices (e.g. '/cpu:0'); other "
        "workers join through `cluster` or `TF_CONFIG`. "
        f"Received: devices={devices!r}")


def resolve_devices(devices):
    """Turns the `devices` argument into a list of full device names.

    `None` means every GPU, or, on a machine without GPUs, every logical CPU.
    """
    available = [d.name for d in _local_logical_devices()]
    if devices is None:
        gpus = [d.name for d in _local_logical_devices("GPU")]
        return gpus or [d.name for d in _local_logical_devices("CPU")]
    if isinstance(devices, str) or not hasattr(devices, "__iter__"):
        raise errors.DeviceError(
            "`devices` must be a list of device names or None. "
            f"Received: devices={devices!r}"
        )
    devices = list(devices)
    if not devices:
        raise errors.DeviceError(
            "`devices` must name at least one device. "
            f"Received: devices={devices!r}"
        )
    for d in devices:
        if not isinstance(d, str):
            raise errors.DeviceError(
                "Each entry of `devices` must be a string. "
                f"Received: devices={devices!r}"
            )
    by_suffix = {
        tf.DeviceSpec.from_string(a).replace(job=None, replica=None, task=None)
        .to_string(): a
        for a in available
    }
    resolved = []
    for d in devices:
        spec = tf.DeviceSpec.from_string(_canonical(d))
        local = spec.replace(job=None, replica=None, task=None).to_string()
        _check_this_task(d, spec, available, devices)
        if local not in by_suffix:
            raise errors.DeviceError(
                f"`devices` names an unknown device {d!r}. Available: "
                f"{sorted(available)}. Received: devices={devices!r}"
            )
        resolved.append(by_suffix[local])
    if len(set(resolved)) != len(resolved):
        raise errors.DeviceError(
            "`devices` must not name a device twice. "
            f"Received: devices={devices!r}"
        )
    return resolved


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


def _start_cluster_from_env(n):
    """With a multi-worker cluster in the environment, builds the strategy.

    `MultiWorkerMirroredStrategy` must be built before TensorFlow
    initialises its runtime (building a model does), so `logical_cpus`
    builds it at once over its `n` CPUs (`import keras_mirror` has already
    done so unless `KERAS_MIRROR_INIT=0`); `MirroredModel` then finds it in
    the cache.
    """
    from keras_mirror.distribute import _multi_worker

    _multi_worker.init(cpus_per_worker=n)


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
