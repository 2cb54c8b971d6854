"""`MirroredModel`'s read-only attributes: replicas, devices, cluster.

A mixin of `MirroredModel` (as Keras's `Model` takes `fit` from its
`Trainer`): what a wrapper is, once built, without how it trains.
"""

from keras_mirror import allreduce
from keras_mirror import split
from keras_mirror.distribute import _multi_worker
from keras_mirror.steps import _execution
from keras_mirror.steps import _replica_stats
from keras_mirror.wrapper import _arguments


class ReplicaAttributes:
    """The public read-only attributes of `MirroredModel`."""

    @property
    def num_replicas(self):
        """The number of replicas (devices) in sync."""
        return self._strategy.num_replicas_in_sync

    @property
    def execution(self):
        """The execution path: `"strategy"`, the one path (see `summary`)."""
        return "strategy"

    @property
    def num_workers(self):
        """Worker processes in the cluster; 1 without a cluster."""
        return 1 if self._cluster is None else self._cluster.num_workers

    @property
    def is_chief(self):
        """Whether this process writes saves, backups and summaries."""
        return self._cluster is None or self._cluster.is_chief

    @property
    def local_replica_ids(self):
        """Global ids of the replicas this worker hosts, in order.

        Worker `w` (its position in the cluster, chief first) hosts
        `w * n_local ... (w + 1) * n_local - 1`.
        """
        n_local = len(self._devices)
        first = _multi_worker.worker_position(self._cluster) * n_local
        return tuple(range(first, first + n_local))

    @property
    def worker_input(self):
        """How input is divided between workers (see `MirroredModel`)."""
        return self._worker_input

    @property
    def virtual_shards(self):
        """Virtual shards of a `tf.data` input (`worker_input="shard"`)."""
        return self._virtual_shards

    @property
    def devices(self):
        """The replicas' device names, in replica order."""
        return self._devices

    @property
    def strategy(self):
        """The `tf.distribute` strategy the replicas run on.

        `MirroredStrategy` on one host, `MultiWorkerMirroredStrategy`
        across hosts; the model's variables get a mirrored twin during each
        wrapper call.
        """
        return self._strategy

    @property
    def replica_stats(self):
        """Whether training steps compute the per-replica statistics."""
        return self._replica_stats

    @property
    def last_replica_logs(self):
        """The per-replica values of the last step, as NumPy vectors.

        A dict `{name: vector of num_replicas values, in replica order}`
        with the names of `replica_history` (`"loss"`, `"samples"`,
        `"grad_norm"`, ... or a model's own step's keys), filled by every
        training step (`fit`, `train_on_batch`) and by `test_on_batch`;
        `{}` before the first step. `train_on_batch` and `test_on_batch`
        return exactly what plain Keras returns; this is where their
        per-replica values are.
        """
        return _replica_stats.last_logs(self)

    @property
    def batch_mode(self):
        """`"global"` or `"per_replica"`."""
        return self._batch_mode

    @property
    def allreduce_bytes_per_step(self):
        """Bytes each replica sends into the gradient all-reduce per step.

        Counts every gradient at its variable's dense size, in
        `gradient_dtype` when set. A sparse gradient (an `Embedding`'s) is
        all-gathered instead, and sends what the replica's shard looked up:
        its rows' values plus an index each, which depends on the batch and
        can be less or more than the dense size.
        """
        return allreduce.bytes_per_step(self.trainable_weights,
                                        self._gradient_dtype)

    def split_plan(self, batch_size, replica_batch_size=None):
        """Rows each replica receives, in replica order.

        Args:
            batch_size: int. Rows in one global batch (in `"per_replica"`
                mode: the rows of the `N` joined replica batches).
            replica_batch_size: int or None. In `"per_replica"` mode, the
                rows of a full replica batch; default `batch_size // N`
                rounded up. Only `"per_replica"` mode takes it.

        Returns:
            A tuple of `num_replicas` ints that sums to `batch_size`.
        """
        if not _arguments.is_int(batch_size) or batch_size < 0:
            raise ValueError(
                "`batch_size` must be a non-negative integer. "
                f"Received: batch_size={batch_size!r}")
        batch_size, n = int(batch_size), self.num_replicas
        if self._batch_mode == "global" and replica_batch_size is not None:
            raise ValueError(
                "`replica_batch_size` applies to `batch='per_replica'` only"
                ": with batch='global' the global batch is split evenly. "
                f"Received: replica_batch_size={replica_batch_size!r}")
        if self._batch_mode == "global":
            return split.balanced_sizes(batch_size, n)
        if replica_batch_size is None:
            return split.fill_sizes(batch_size, n, -(-batch_size // n))
        if not _arguments.is_int(replica_batch_size) or \
                replica_batch_size < 1:
            raise ValueError(
                "`replica_batch_size` must be a positive integer or None. "
                f"Received: replica_batch_size={replica_batch_size!r}")
        replica_batch_size = int(replica_batch_size)
        if replica_batch_size * n < batch_size:
            raise ValueError(
                f"`replica_batch_size` is too small: {n} replica batches of "
                f"{replica_batch_size} rows hold {replica_batch_size * n}, "
                f"fewer than the {batch_size} rows of the global batch. "
                f"Received: replica_batch_size={replica_batch_size!r}, "
                f"batch_size={batch_size!r}")
        return split.fill_sizes(batch_size, n, replica_batch_size)

    @property
    def execution_summary(self):
        """One line: which execution path runs, and why."""
        return _execution.describe(self._execution_reason, self._strategy)
