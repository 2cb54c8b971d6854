"""Routing per-replica vectors through Keras callbacks.

`train_step` returns, beside the usual global keys, vectors of length
`num_replicas` under the keys `replica_*`. Keras's `ProgbarLogger` would show
their mean and Keras's `TensorBoard` rejects non-scalars, so
`ReplicaCallbackList` hands those two callbacks the logs without the vectors;
every other callback (History, CSVLogger, yours) receives them.
"""

import functools
import warnings

import keras
import numpy as np

from keras_mirror import errors

PREFIX = "replica_"
# The built-in train step's per-replica statistics, in this order.
STAT_KEYS = (
    "replica_loss",
    "replica_samples",
    "replica_sample_weight",
    "replica_grad_norm",
    "replica_nonfinite",
    "replica_step_time",
)
# The train step returns them as one float32 matrix under this key, one row
# per replica and one column per `STAT_KEYS` entry: one output tensor and one
# device-to-host copy per step instead of six, which measured ~5% of a 2 ms
# step (`benchmarks/README.md`). `unpacking` splits it back into the
# `replica_*` vectors before Keras or any callback sees the logs.
PACKED = "_replica_stats"
# How each per-step vector turns into an epoch value per replica.
_EPOCH_SUM = ("replica_samples", "replica_sample_weight", "replica_nonfinite")


def strip(logs):
    """`logs` without the per-replica vectors."""
    if not logs:
        return logs
    return {k: v for k, v in logs.items() if not k.startswith(PREFIX)}


def _wants_vectors(callback):
    if getattr(callback, "wants_replica_logs", False):
        return True
    return not isinstance(
        callback, (keras.callbacks.ProgbarLogger, keras.callbacks.TensorBoard)
    )


class ReplicaCallbackList(keras.callbacks.CallbackList):
    """A `CallbackList` that keeps replica vectors from Progbar/TensorBoard."""

    def _dispatch(self, hook, *args, logs=None):
        for callback in self.callbacks:
            cb_logs = logs if _wants_vectors(callback) else strip(logs)
            getattr(callback, hook)(*args, logs=cb_logs)

    def on_train_batch_end(self, batch, logs=None):
        self._dispatch("on_train_batch_end", batch, logs=_numpy(logs))

    def on_test_batch_end(self, batch, logs=None):
        self._dispatch("on_test_batch_end", batch, logs=_numpy(logs))

    def on_predict_batch_end(self, batch, logs=None):
        self._dispatch("on_predict_batch_end", batch, logs=logs)

    def on_epoch_end(self, epoch, logs=None):
        self._dispatch("on_epoch_end", epoch, logs=_numpy(logs))

    def on_test_end(self, logs=None):
        self._dispatch("on_test_end", logs=_numpy(logs))

    def on_train_end(self, logs=None):
        self._dispatch("on_train_end", logs=_numpy(logs))


def unpack(logs):
    """`logs` with the packed statistics split into `replica_*` vectors."""
    if not isinstance(logs, dict) or PACKED not in logs:
        return logs
    logs = dict(logs)
    columns = np.ascontiguousarray(np.asarray(logs.pop(PACKED)).T)
    for key, column in zip(STAT_KEYS, columns):
        logs[key] = column
    return logs


def unpacking(function):
    """Wraps a Keras train function so that its logs come unpacked."""
    if function is None or getattr(function, "_unpacks_replica_stats",
                                   False):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        return unpack(function(*args, **kwargs))

    call._unpacks_replica_stats = True
    return call


def _numpy(logs):
    if logs is None:
        return None
    out = {}
    for k, v in logs.items():
        if hasattr(v, "numpy"):
            v = v.numpy()
        if isinstance(v, np.generic) or (
                isinstance(v, np.ndarray) and v.ndim == 0):
            v = float(v)
        out[k] = v
    return out


class ReplicaHistory(keras.callbacks.Callback):
    """Records per-replica series and reports non-finite values.

    Always first in `MirroredModel.fit`'s callback list. At each epoch end it
    replaces the last step's `replica_*` vectors in `logs` by epoch values
    (sums for samples and non-finite counts, a sample-weighted mean for the
    loss, means otherwise), so that every later callback sees those.
    """

    wants_replica_logs = True

    def __init__(self, mirrored):
        super().__init__()
        self._mirrored = mirrored
        self._epoch = []
        self._step = 0

    def on_train_begin(self, logs=None):
        self._step = int(self._mirrored.optimizer.iterations.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = []

    def on_train_batch_end(self, batch, logs=None):
        vectors = {k: np.asarray(v, dtype=np.float64)
                   for k, v in (logs or {}).items() if k.startswith(PREFIX)}
        if not vectors:
            return
        self._step += 1
        self._epoch.append(vectors)
        self._mirrored.replica_history.setdefault("batch", []).append(
            {k[len(PREFIX):]: v.tolist() for k, v in vectors.items()})
        bad = vectors.get("replica_nonfinite")
        if bad is not None and bad.any():
            self._report(bad, self._step)

    def _report(self, bad, step):
        replicas = [int(i) for i in np.flatnonzero(bad)]
        mode = self._mirrored.on_nonfinite
        action = {"warn": "the update was applied",
                  "skip_step": "the update was skipped on all replicas",
                  "raise": "the update was skipped"}[mode]
        counts = bad[replicas].astype(int).tolist()
        message = (
            f"Non-finite loss or gradient values at step {step} on "
            f"replica(s) {replicas} (counts {counts}); {action}."
        )
        if mode == "raise":
            self._mirrored.stop_training = True
            raise errors.NonFiniteError(
                message + " Set `on_nonfinite='skip_step'` or 'warn' to go "
                f"on. Received: on_nonfinite={mode!r}")
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def on_epoch_end(self, epoch, logs=None):
        if not self._epoch or logs is None:
            return
        epoch_values = epoch_aggregates(self._epoch)
        logs.update(epoch_values)
        history = self._mirrored.replica_history
        for key, value in epoch_values.items():
            history.setdefault(key[len(PREFIX):], []).append(value.tolist())


def epoch_aggregates(steps):
    """Epoch values per replica from a list of per-step vector dicts."""
    stacked = {k: np.stack([s[k] for s in steps]) for k in steps[0]}
    out = {}
    for key, values in stacked.items():
        if key in _EPOCH_SUM:
            out[key] = values.sum(axis=0)
        elif key == "replica_loss" and "replica_samples" in stacked:
            rows = stacked["replica_samples"]
            total = rows.sum(axis=0)
            weighted = (values * rows).sum(axis=0)
            out[key] = np.divide(weighted, total, out=np.zeros_like(total),
                                 where=total > 0)
        else:
            out[key] = values.mean(axis=0)
    return out
