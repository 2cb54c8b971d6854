"""Multi-worker set-up of `MirroredModel`: cluster, input layout, logging.

Input between workers (`worker_input="replicate"`, the only mode so far):
every worker reads the same, full global batches (the input must be
deterministic and identical on every worker: same data, same order, no
unseeded shuffling) and keeps only its own replicas' rows of the global
split plan over all replicas. The global batch therefore spans all
replicas of all workers, exactly as on one host, and the trained weights
equal single-device training on the same global batches. The cost is that
each worker reads (but does not compute on) the whole batch.
"""

import sys

from keras_mirror import cluster as cluster_lib

WORKER_INPUT_MODES = ("replicate",)


def cluster_spec(cluster):
    """The `ClusterSpec` to train on, or None for one host.

    `cluster` None reads `TF_CONFIG` (`cluster_from_env`); else a
    `ClusterSpec` or a `TF_CONFIG`-shaped dict / JSON string. A cluster of
    one task means one host.
    """
    if cluster is None:
        return cluster_lib.cluster_from_env()
    if not isinstance(cluster, cluster_lib.ClusterSpec):
        cluster = cluster_lib.parse_cluster(cluster)
    return cluster if cluster.num_workers > 1 else None


def check_worker_input(worker_input, spec):
    if worker_input not in WORKER_INPUT_MODES:
        raise ValueError(
            f"`worker_input` must be one of {WORKER_INPUT_MODES} (every "
            "worker reads the full global batch and keeps its replicas' "
            f"rows). Received: worker_input={worker_input!r}")


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


def layout_message(num_workers, n_local):
    return (f"multi-worker: {num_workers} workers x {n_local} replicas; "
            "input: every worker reads the full global batch and keeps "
            "its replicas' rows")


def log_layout(mirrored):
    """Logs (to stderr) how replicas and input are laid out."""
    message = layout_message(mirrored.num_workers, len(mirrored.devices))
    print(f"keras-mirror: {message} (this worker: task "
          f"{mirrored._cluster.task_type}:{mirrored._cluster.task_index}, "
          f"replicas {list(mirrored.local_replica_ids)}"
          f"{', chief' if mirrored.is_chief else ''}).",
          file=sys.stderr, flush=True)
