"""`ReplicaTensorBoard`: one TensorBoard run per replica."""

import logging
import os

import keras
import numpy as np
import tensorflow as tf

from keras_mirror.callbacks import _replica_logs

_LOG = logging.getLogger(__name__)
_PREFIX = _replica_logs.PREFIX
_VAL_PREFIX = "val_"


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

    def __init__(self, log_dir="logs", update_freq="epoch",
                 write_global=True):
        super().__init__()
        if not isinstance(write_global, bool):
            raise ValueError(
                "`write_global` must be True or False. "
                f"Received: write_global={write_global!r}")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.write_global = write_global
        self._every = _batch_interval(update_freq)
        self._writers = {}
        self._functions = {}
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
                self._writers[run] = tf.summary.create_file_writer(path)
            except Exception as e:  # noqa: BLE001 - optional feature
                _LOG.warning("ReplicaTensorBoard cannot write to %r (%s); "
                             "skipping this run.", path, e)
                self._writers[run] = None
        return self._writers[run]

    def _write(self, run, scalars, step):
        """Writes `{tag: value}` to the run's writer; logs failures."""
        if not scalars:
            return
        writer = self._writer(run)
        if writer is None:
            return
        try:
            # `record_if(True)`: Keras's TensorBoard, when batch-level,
            # leaves a `record_if` of its own `update_freq` active.
            with writer.as_default(), tf.summary.record_if(True):
                for tag, value in scalars.items():
                    tf.summary.scalar(tag, value, step=step)
        except Exception as e:  # noqa: BLE001 - optional feature
            _LOG.warning("ReplicaTensorBoard failed to write run %r (%s); "
                         "skipping this run.", run, e)
            self._close(run)
            self._writers[run] = None

    def _write_runs(self, per_run, step):
        """Writes `{run: {tag: value}}` in one graph call.

        One `tf.function` per layout of runs and tags costs a fraction of
        the eager `tf.summary.scalar` calls it replaces. On any error it
        falls back to `_write`, run by run, which logs and skips bad runs.
        """
        layout = tuple(
            (run, tuple(scalars)) for run, scalars in per_run.items()
            if scalars and self._writer(run) is not None)
        if not layout:
            return
        values = [per_run[run][tag] for run, tags in layout for tag in tags]
        try:
            if layout not in self._functions:
                self._functions[layout] = _scalar_writer(
                    [(self._writers[run], tags) for run, tags in layout])
            self._functions[layout](tf.constant(step, tf.int64),
                                    tf.constant(values, tf.float32))
        except Exception:  # noqa: BLE001 - retried eagerly, run by run
            self._functions.pop(layout, None)
            for run, scalars in per_run.items():
                self._write(run, scalars, step)

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
        self._functions = {}

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
        self._functions = {}


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


def _scalar_writer(writers_and_tags):
    """A `tf.function(step, values)` writing `values` in layout order."""

    @tf.function(input_signature=[
        tf.TensorSpec([], tf.int64),
        tf.TensorSpec([sum(len(t) for _, t in writers_and_tags)],
                      tf.float32),
    ])
    def write(step, values):
        i = 0
        for writer, tags in writers_and_tags:
            # `record_if(True)`: Keras's TensorBoard, when batch-level,
            # leaves a `record_if` of its own `update_freq` active.
            with writer.as_default(), tf.summary.record_if(True):
                for tag in tags:
                    tf.summary.scalar(tag, values[i], step=step)
                    i += 1

    return write


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
