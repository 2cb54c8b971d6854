"""Device discovery and logical CPU devices.

The strategies themselves are built in `_strategies` (re-exported here, as
before); `logical_cpus` starts a multi-worker cluster through
`_multi_worker.init`, which builds its strategy there: `devices` ->
`_multi_worker` -> `_strategies`, one way.
"""

import tensorflow as tf

from keras_mirror import errors
from keras_mirror.distribute import _multi_worker
from keras_mirror.distribute import _strategies

# Here as before (`keras_mirror.devices.mirrored_strategy(...)`).
mirrored_strategy = _strategies.mirrored_strategy
multi_worker_strategy = _strategies.multi_worker_strategy


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
    worker = _strategies.multi_worker_device()
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
    # `tf.config.list_logical_devices("GPU")` gives `LogicalDevice`s: their
    # names are the device names.
    devices = [d.name if isinstance(d, tf.config.LogicalDevice) else d
               for d in devices]
    for d in devices:
        if not isinstance(d, str):
            raise errors.DeviceError(
                "Each entry of `devices` must be a device name (a string, "
                "such as '/gpu:0') or a `tf.config.LogicalDevice`. "
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


def _start_cluster_from_env(n):
    """With a multi-worker cluster in the environment, builds the strategy.

    `MultiWorkerMirroredStrategy` must be built before TensorFlow
    initialises its runtime (building a model does), so `logical_cpus`
    builds it at once over its `n` CPUs (`import keras_mirror` has already
    done so unless `KERAS_MIRROR_INIT=0`); `MirroredModel` then finds it in
    the cache.
    """
    _multi_worker.init(cpus_per_worker=n)
