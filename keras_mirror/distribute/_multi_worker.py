"""Multi-worker set-up of `MirroredModel`: cluster, devices, input layout.

Where the cluster comes from (`cluster_spec`): the `cluster` argument (a
`ClusterSpec`, a `TF_CONFIG`-shaped dict or JSON string, or any of
TensorFlow's `ClusterResolver`s), else the environment: `TF_CONFIG` (the
launcher, Kubernetes' Kubeflow `TFJob`, or set by hand), else a Slurm job
step started by `srun` with two or more tasks (read by TensorFlow's
`SlurmClusterResolver`).

`init()` builds this worker's `MultiWorkerMirroredStrategy`, which
TensorFlow only allows before it initialises its devices (building a model
does). `import keras_mirror` calls it when the environment names a
cluster, so that a plain script (build, wrap, fit) needs no other line.

Input between workers: with `worker_input="replicate"` every worker reads
the same, full global batches (the input must be deterministic and
identical on every worker) and keeps its own replicas' rows of the split
plan; with `worker_input="shard"` each worker reads only its rows of
arrays (`_worker_input`) or its virtual shards of a `tf.data` input
(`_virtual_shards`).
"""

import os
import sys

from keras_mirror import errors
from keras_mirror.distribute import cluster as cluster_lib

WORKER_INPUT_MODES = ("replicate", "shard")
INIT_ENV = "KERAS_MIRROR_INIT"
CPUS_ENV = "KERAS_MIRROR_CPUS_PER_WORKER"
PORT_BASE_ENV = "KERAS_MIRROR_PORT_BASE"
READY_FILE_ENV = "KERAS_MIRROR_READY_FILE"
VIRTUAL_SHARDS_ENV = "KERAS_MIRROR_VIRTUAL_SHARDS"
# A worker that stopped for a preemption (SIGTERM) after writing its step
# backup exits with this code (EX_TEMPFAIL: "try again"); the launcher
# restarts the group without counting it against `--max-restarts`.
PREEMPTED_EXIT_CODE = 75
_state = {"spec": None, "devices": None, "source": None}


# -- the cluster -----------------------------------------------------------

def _is_resolver(value):
    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(value, tf.distribute.cluster_resolver.ClusterResolver)


def _slurm_step(environ):
    """Whether this process is one of 2+ tasks of an `srun` job step."""
    if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return False
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get(
        "SLURM_NTASKS", "1")
    return tasks.isdigit() and int(tasks) > 1


def slurm_resolver():
    """TensorFlow's `SlurmClusterResolver` for this `srun` step.

    Task `i` of a node listens on `KERAS_MIRROR_PORT_BASE + i` (default
    8888, as TensorFlow). On hosts without GPUs, TensorFlow's resolver
    would count GPUs with
    `nvidia-smi` and drop the tasks that get none; there every task is
    given a nominal GPU slot (only the ports matter) and `CUDA_VISIBLE_DEVICES`
    is left alone.
    """
    import shutil

    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver
    # Not `tf.config.list_physical_devices`: the resolver sets
    # `CUDA_VISIBLE_DEVICES` per task, which must happen before CUDA starts.
    port_base = _port_base()
    if "CUDA_VISIBLE_DEVICES" in os.environ or shutil.which("nvidia-smi"):
        return resolver(port_base=port_base)
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1")
    most = max(int(part.split("(")[0]) for part in per_node.split(","))
    return resolver(port_base=port_base, gpus_per_node=most,
                    gpus_per_task=1, auto_set_gpu=False)


def _port_base():
    """The first port of each Slurm node's tasks (`KERAS_MIRROR_PORT_BASE`)."""
    text = os.environ.get(PORT_BASE_ENV, "8888")
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(
            f"`{PORT_BASE_ENV}` must be a port number (the first port of "
            f"each node's tasks). Received: {PORT_BASE_ENV}={text!r}")
    return int(text)


def cluster_from_environment(environ=None):
    """The cluster the environment names (`TF_CONFIG`, else Slurm), or None.

    Also returns the source, `"TF_CONFIG"` or `"Slurm"`.
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CONFIG", "").strip():
        return cluster_lib.cluster_from_env(environ), "TF_CONFIG"
    if _slurm_step(environ):
        return cluster_lib.cluster_from_resolver(slurm_resolver()), "Slurm"
    return None, None


def cluster_spec(cluster):
    """The `ClusterSpec` to train on, or None for one host.

    `cluster` None reads the environment (`cluster_from_environment`);
    else a `ClusterSpec`, a TensorFlow `ClusterResolver` or a
    `TF_CONFIG`-shaped dict / JSON string. A cluster of one task means one
    host.
    """
    if cluster is None:
        if _state["spec"] is not None:
            return _state["spec"]
        return cluster_from_environment()[0]
    if _is_resolver(cluster):
        cluster = cluster_lib.cluster_from_resolver(cluster)
    elif not isinstance(cluster, cluster_lib.ClusterSpec):
        cluster = cluster_lib.parse_cluster(cluster)
    return cluster if cluster.num_workers > 1 else None


# -- setting up this worker ------------------------------------------------

def _cpus_per_worker(cpus_per_worker):
    if cpus_per_worker is None:
        text = os.environ.get(CPUS_ENV, "1")
        if not text.isdigit() or int(text) < 1:
            raise ValueError(
                f"`{CPUS_ENV}` must be a positive integer (logical CPU "
                f"replicas per worker). Received: {CPUS_ENV}={text!r}")
        return int(text)
    if isinstance(cpus_per_worker, bool) or not isinstance(
            cpus_per_worker, int) or cpus_per_worker < 1:
        raise ValueError(
            "`cpus_per_worker` must be a positive integer. "
            f"Received: cpus_per_worker={cpus_per_worker!r}")
    return cpus_per_worker


def _worker_devices(cpus_per_worker):
    """This worker's replica devices: every GPU, else N logical CPUs."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/device:GPU:{i}" for i in range(len(gpus))]
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()
                  for _ in range(cpus_per_worker)])
    except RuntimeError:
        pass  # initialised already: building the strategy says so
    return [f"/device:CPU:{i}" for i in range(cpus_per_worker)]


def init(cluster=None, cpus_per_worker=None):
    """Sets this process up as one worker of a multi-worker cluster.

    Builds the worker's `MultiWorkerMirroredStrategy` (which waits until
    every peer has joined) over all its GPUs or, without GPUs, over
    `cpus_per_worker` logical CPUs. TensorFlow only allows this before it
    initialises its devices, so it must run before a model is built.
    `import keras_mirror` already calls it when the environment names a
    cluster (`TF_CONFIG`, or an `srun` step of 2+ tasks), unless
    `KERAS_MIRROR_INIT=0`; call it yourself to pass a `ClusterResolver`.
    `MirroredModel` then trains on this strategy. Without a cluster it
    does nothing. Calling it again with the same cluster is a no-op.

    Args:
        cluster: `None` (read the environment), a TensorFlow
            `ClusterResolver` (e.g. `SlurmClusterResolver(port_base=...)`),
            a `TF_CONFIG`-shaped dict or JSON string, or a
            `keras_mirror.cluster.ClusterSpec`; default `None`.
        cpus_per_worker: int or `None`. Logical CPU replicas per worker on
            hosts without GPUs; default `None`: the
            `KERAS_MIRROR_CPUS_PER_WORKER` variable (which
            `keras-mirror launch --cpus-per-worker` sets), else 1.

    Returns:
        This worker's `keras_mirror.cluster.ClusterSpec`, or `None` when
        there is no cluster of two or more workers.

    Raises:
        DevicesAlreadyInitializedError: if TensorFlow initialised its
            devices first; the message names the line to move.
        ClusterConfigError: if the cluster description is malformed.

    Example:

    ```python
    import keras_mirror
    keras_mirror.init()  # optional: `import keras_mirror` already did
    model = build_model()
    keras_mirror.MirroredModel(model).fit(ds, epochs=3)
    ```
    """
    cpus = _cpus_per_worker(cpus_per_worker)
    spec = cluster_spec(cluster)
    if spec is None:
        return None
    if _state["spec"] == spec and cpus_per_worker is None:
        return spec
    devices = _worker_devices(cpus)  # another cluster or count: refused
    from keras_mirror.distribute import _strategies  # TensorFlow: only now

    _strategies.multi_worker_strategy(spec, devices)
    _state.update(spec=spec, devices=devices)
    mark_ready()
    return spec


def _caller_line():
    """`file, line, source` of the user's code that is importing us."""
    frame = sys._getframe(1)
    # The package's own frames (any subpackage) are skipped.
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(ours) and "importlib" not in name and \
                not name.startswith("<frozen"):
            break
        frame = frame.f_back
    if frame is None:
        return None
    import linecache

    source = linecache.getline(frame.f_code.co_filename,
                               frame.f_lineno).strip()
    return frame.f_code.co_filename, frame.f_lineno, source


def auto_init():
    """`init()` at `import keras_mirror`, when the environment names a cluster.

    TensorFlow is not imported unless it does. A failure because TensorFlow
    was initialised first names the import line to move.
    """
    if os.environ.get(INIT_ENV, "1") == "0":
        return
    program = sys.argv[0] if sys.argv else ""
    if os.path.basename(program) == "keras-mirror" or program == "-m":
        return  # the launcher itself (`keras-mirror`, `python -m ...`)
    environ = os.environ
    if not environ.get("TF_CONFIG", "").strip() and not _slurm_step(environ):
        return
    try:
        init()
    except errors.DevicesAlreadyInitializedError:
        where = _caller_line()
        line = "" if where is None else (
            f" ({os.path.basename(where[0])}, line {where[1]}: "
            f"`{where[2]}`)")
        raise errors.DevicesAlreadyInitializedError(
            "keras-mirror sets up this worker's multi-worker strategy when "
            "it is imported, before TensorFlow initialises its devices; "
            "they were already initialised. Move `import keras_mirror`"
            f"{line} above the first line that builds a model or runs "
            "TensorFlow (a tensor, a layer, `tf.config.list_logical_"
            "devices`). Received: a cluster of "
            f"{cluster_spec(None).num_workers} workers from the "
            "environment") from None


def mark_ready():
    """Tells `keras-mirror launch` that this worker has started.

    Creates the file named by the `KERAS_MIRROR_READY_FILE` environment
    variable (atomically, with this process's id in it). Outside the
    launcher, where the variable is unset, it does nothing. `init()` and
    `MirroredModel` call it once the strategy is built (which waits for
    every peer). Calling it again is harmless.

    Returns:
        `True` if a ready file was written, `False` if the variable is
        unset.
    """
    path = os.environ.get(READY_FILE_ENV)
    if not path:
        return False
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(temporary, path)
    return True


def initialized_devices():
    """The devices `init()` built the strategy over, or None."""
    return _state["devices"]


# -- input -----------------------------------------------------------------

def check_worker_input(worker_input, spec):
    if worker_input not in WORKER_INPUT_MODES:
        raise ValueError(
            f"`worker_input` must be one of {WORKER_INPUT_MODES} "
            "('replicate': every worker reads the full global batch and "
            "keeps its replicas' rows; 'shard': every worker reads only its "
            f"replicas' rows). Received: worker_input={worker_input!r}")


def worker_position(spec):
    """This task's position among the workers, as `tf.distribute` counts.

    The chief (if any) is 0 and worker `i` follows it; without a chief,
    worker `i` is `i`.
    """
    if spec is None:
        return 0
    if spec.chief is None:
        return spec.task_index
    return 0 if spec.task_type == "chief" else spec.task_index + 1


_INPUT = {
    "replicate": "every worker reads the full global batch and keeps its "
                 "replicas' rows",
    "shard": "every worker reads only its replicas' rows of each global "
             "batch",
}


def layout_message(num_workers, n_local, worker_input="replicate"):
    return (f"multi-worker: {num_workers} workers x {n_local} replicas; "
            f"input: {_INPUT[worker_input]}")


def log_layout(mirrored):
    """Logs (to stderr) how replicas and input are laid out."""
    message = layout_message(mirrored.num_workers, len(mirrored.devices),
                             mirrored.worker_input)
    print(f"keras-mirror: {message} (this worker: task "
          f"{mirrored._cluster.task_type}:{mirrored._cluster.task_index}, "
          f"replicas {list(mirrored.local_replica_ids)}"
          f"{', chief' if mirrored.is_chief else ''}).",
          file=sys.stderr, flush=True)
