"""`ReplicaTensorBoard`: one TensorBoard run per replica."""

import logging
import os
import time

import keras
import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.compat.proto import types_pb2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from keras_mirror.steps import _replica_stats

_LOG = logging.getLogger(__name__)
_PREFIX = _replica_stats.PREFIX
_VAL_PREFIX = "val_"
_SCALAR_METADATA = scalar_metadata.create_summary_metadata(
    display_name=None, description=None)


class ReplicaTensorBoard(keras.callbacks.Callback):
    """Writes per-replica and global scalars for TensorBoard.

    Each replica gets its own run, `log_dir/replica_0/`, `log_dir/replica_1/`,
    ..., holding Keras-style tags made from the `replica_*` vectors that
    `MirroredModel.fit` puts in `logs`: `replica_loss` becomes `batch_loss`
    and `epoch_loss`, `replica_samples` becomes `batch_samples` and
    `epoch_samples`, and so on for `sample_weight`, `grad_norm`, `nonfinite`,
    `step_time` and any `replica_<name>` vector a custom `train_step` adds.
    Because the runs share tag names, TensorBoard overlays the replicas'
    curves on one chart per tag.

    The global values go where Keras's `TensorBoard` puts them, with its
    tags: `log_dir/train` (`epoch_loss`, `epoch_<metric>`, and `batch_*` at
    batch granularity) and `log_dir/validation` (the `val_*` keys without
    their prefix). Steps count as in Keras: the index of the epoch for
    `epoch_*` tags, the number of train batches since the start of `fit`
    (from 1) for `batch_*` tags.

    It runs beside `keras.callbacks.TensorBoard` on the same `log_dir`;
    pass `write_global=False` then, or both callbacks write the global tags
    to `train/` and `validation/` and TensorBoard draws every point twice.
    Place it anywhere in the callback list. Writers are created when first
    needed and closed at the end of training; a writer that fails is
    logged and skipped, never raised. In multi-worker training only the
    chief writes `train/` and `validation/`; every worker writes the runs of
    its own replicas.

    The epoch values of the replica vectors are those `MirroredModel`'s
    `ReplicaHistory` computes (sums of samples, sample weights and
    non-finite counts; the samples-weighted mean loss; means otherwise).
    With `update_freq="epoch"` this callback overrides no batch hook, so
    Keras can dispatch batch callbacks asynchronously.

    Args:
        log_dir: str or path-like. The directory of the runs; default
            `"logs"`.
        update_freq: `"epoch"`, `"batch"` or int. `"epoch"` (default) writes
            once per epoch; `"batch"` also writes every train batch; an int
            `n` writes every `n`th train batch, as `keras.callbacks.
            TensorBoard` does.
        write_global: bool. Whether to write the global scalars to `train/`
            and `validation/`; default True. Set it to False when a
            `keras.callbacks.TensorBoard` writes the same `log_dir`.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_mirror

    keras_mirror.logical_cpus(4)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 8)), np.ones((64, 1))
    mirrored.fit(x, y, batch_size=16, epochs=2, callbacks=[
        keras_mirror.ReplicaTensorBoard("runs/", update_freq="batch",
                                        write_global=False),
        keras.callbacks.TensorBoard("runs/", update_freq="batch"),
    ])
    # tensorboard --logdir runs/  -> runs replica_0 ... replica_3, train
    ```
    """

    wants_replica_logs = True
    _wants_wrapper = True  # reads the replicas (`_user_model`)

    def __init__(self, log_dir="logs", update_freq="epoch",
                 write_global=True):
        super().__init__()
        if not isinstance(write_global, bool):
            raise ValueError(
                "`write_global` must be True or False. "
                f"Received: write_global={write_global!r}")
        if isinstance(log_dir, bytes) or not isinstance(
                log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise ValueError(
                "`log_dir` must be a non-empty str or path-like. "
                f"Received: log_dir={log_dir!r}")
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise ValueError(
                "`log_dir` must be a directory, or a path where one can be "
                "made: it names an existing file, where no run can be "
                f"written. Received: log_dir={os.fspath(log_dir)!r}")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.write_global = write_global
        self._every = _batch_interval(update_freq)
        self._writers = {}
        self._global_train_batch = 0
        if self._every is not None:
            # Bound here, not defined on the class: with "epoch" the hook
            # stays Keras's default and batch callbacks may run async.
            self.on_train_batch_end = self._on_train_batch_end

    # -- writers -----------------------------------------------------------

    def _writer(self, run):
        """The writer of `log_dir/run`, created on first use; None if bad."""
        if run not in self._writers:
            path = os.path.join(self.log_dir, run)
            try:
                self._writers[run] = EventFileWriter(path)
            except Exception as e:  # noqa: BLE001 - optional feature
                _LOG.warning("ReplicaTensorBoard cannot write to %r (%s); "
                             "skipping this run.", path, e)
                self._writers[run] = None
        return self._writers[run]

    def _write_runs(self, per_run, step):
        """Writes `{run: {tag: value}}`: one event per run.

        The events are built here on the host from the values `fit` has
        already fetched (every tag of a run in one `Summary`, with the
        metadata `tf.summary.scalar` gives a scalar), and TensorBoard's
        `EventFileWriter` writes them from its own thread: no TensorFlow op
        runs, and the step waits for no file. A writer that fails is
        logged, closed and skipped.
        """
        wall_time = time.time()
        for run, scalars in per_run.items():
            if not scalars:
                continue
            writer = self._writer(run)
            if writer is None:
                continue
            try:
                writer.add_event(event_pb2.Event(
                    wall_time=wall_time, step=int(step),
                    summary=_summary(scalars)))
            except Exception as e:  # noqa: BLE001 - optional feature
                _LOG.warning("ReplicaTensorBoard failed to write run %r "
                             "(%s); skipping this run.", run, e)
                self._close(run)
                self._writers[run] = None

    def _close(self, run):
        writer = self._writers.get(run)
        if writer is None:
            return
        try:
            writer.close()
        except Exception as e:  # noqa: BLE001 - optional feature
            _LOG.warning("ReplicaTensorBoard failed to close run %r (%s).",
                         run, e)

    def _flush(self):
        for run, writer in list(self._writers.items()):
            if writer is None:
                continue
            try:
                writer.flush()
            except Exception as e:  # noqa: BLE001 - optional feature
                _LOG.warning("ReplicaTensorBoard failed to flush run %r "
                             "(%s).", run, e)

    # -- routing logs to runs ----------------------------------------------

    def _replica_ids(self, length):
        ids = getattr(self.model, "local_replica_ids", None)
        if ids is None:
            ids = range(getattr(self.model, "num_replicas", length))
        return [int(r) for r in ids]

    def _write_logs(self, logs, prefix, step, split_validation):
        """Writes global scalars (chief only) and local replica runs."""
        logs = logs or {}
        vectors = {k[len(_PREFIX):]: np.asarray(v).reshape(-1)
                   for k, v in logs.items() if k.startswith(_PREFIX)}
        per_run = {}
        if vectors:
            ids = self._replica_ids(len(next(iter(vectors.values()))))
            for r in ids:
                per_run[f"replica_{r}"] = {
                    prefix + name: float(v[r])
                    for name, v in vectors.items() if r < v.size
                }
        if self.write_global and getattr(self.model, "is_chief", True):
            per_run["train"], per_run["validation"] = _global_scalars(
                logs, prefix, split_validation)
        self._write_runs(per_run, step)

    # -- Keras hooks -------------------------------------------------------

    def set_model(self, model):
        super().set_model(model)
        self._writers = {}

    def on_train_begin(self, logs=None):
        if getattr(self.model, "replica_stats", True) is False:
            raise ValueError(
                "ReplicaTensorBoard writes per-replica statistics, and this "
                "MirroredModel computes none. Construct it with "
                "`replica_stats=True` (the default), or log the global "
                "values with `keras.callbacks.TensorBoard`. Received: "
                "replica_stats=False")
        self._global_train_batch = 0

    def _on_train_batch_end(self, batch, logs=None):
        self._global_train_batch += 1
        step = self._global_train_batch
        if step % self._every == 0:
            self._write_logs(logs, "batch_", step, split_validation=False)

    def on_epoch_end(self, epoch, logs=None):
        self._write_logs(logs, "epoch_", epoch, split_validation=True)
        self._flush()

    def on_train_end(self, logs=None):
        for run in list(self._writers):
            self._close(run)
        self._writers = {}


def _global_scalars(logs, prefix, split_validation):
    """`(train, validation)` dicts of tag -> value from the scalar keys."""
    train, val = {}, {}
    for key, value in logs.items():
        if key.startswith(_PREFIX) or np.ndim(value) != 0:
            continue
        if split_validation and key.startswith(_VAL_PREFIX):
            val[prefix + key[len(_VAL_PREFIX):]] = float(value)
        else:
            train[prefix + key] = float(value)
    return train, val


def _summary(scalars):
    """`{tag: value}` as a `Summary` of float32 scalar tensors.

    Each value carries the metadata `tf.summary.scalar` gives it, so that
    TensorBoard (and its `EventAccumulator`) reads the same tags.
    """
    summary = summary_pb2.Summary()
    for tag, value in scalars.items():
        entry = summary.value.add(tag=tag)
        entry.metadata.CopyFrom(_SCALAR_METADATA)
        entry.tensor.dtype = types_pb2.DT_FLOAT
        entry.tensor.float_val.append(value)
    return summary


def _batch_interval(update_freq):
    """Batches between writes, or None for `"epoch"`; validates."""
    if update_freq == "epoch":
        return None
    if update_freq == "batch":
        return 1
    if isinstance(update_freq, int) and not isinstance(update_freq, bool) \
            and update_freq > 0:
        return update_freq
    raise ValueError(
        '`update_freq` must be "epoch", "batch" or a positive integer. '
        f"Received: update_freq={update_freq!r}")
