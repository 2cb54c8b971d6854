"""`ReplicaHistory`: the per-replica vectors of every step and epoch.

`MirroredModel.fit` puts it first in the callback list (through
`_replica_logs.ReplicaCallbackList`); it fills `mirrored.replica_history`
and acts on a non-finite loss or gradient as `on_nonfinite` asks.
"""

import bisect
import collections.abc
import operator
import warnings

import keras
import numpy as np

from keras_mirror import errors
from keras_mirror.callbacks import _replica_logs
from keras_mirror.steps._replica_stats import PREFIX

# How each per-step vector turns into an epoch value per replica.
_EPOCH_SUM = ("replica_samples", "replica_sample_weight", "replica_nonfinite")


class StepHistory(collections.abc.Sequence):
    """`mirrored.replica_history["batch"]`: per-replica values of each step.

    Item `i` is step `i`'s dict `{name: [value of each replica]}`, the names
    without the `replica_` prefix (`"loss"`, `"samples"`, ...), built when
    read; `array(name)` gives one name's `[steps, replicas]` array.

    Each step is kept as one float64 `[names, replicas]` array: 8 bytes per
    value, and no Python object per value. A dict of lists per step took
    ~1.6 KB at 4 replicas, and the garbage collector's passes over those
    lists made every later step's bookkeeping slower as training went on.
    """

    def __init__(self):
        self._rows = []  # one [names, replicas] float64 array per step
        self._starts = []  # the first step of each layout of names
        self._layouts = []  # the names (without prefix) of each layout

    def append(self, names, matrix):
        """Adds one step: `names` (a tuple) label the rows of `matrix`."""
        if not self._layouts or self._layouts[-1] != names:
            self._starts.append(len(self._rows))
            self._layouts.append(names)
        self._rows.append(matrix)

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = operator.index(index)
        if index < 0:
            index += len(self._rows)
        if not 0 <= index < len(self._rows):
            raise IndexError(
                f"Step index out of range: {len(self._rows)} steps recorded."
                f" Received: index={index}")
        names = self._layouts[bisect.bisect_right(self._starts, index) - 1]
        return {n: v.tolist() for n, v in zip(names, self._rows[index])}

    def array(self, name):
        """`name`'s values as a `[steps, replicas]` float64 array.

        Steps that did not log `name` hold NaN.
        """
        if not any(name in layout for layout in self._layouts):
            raise KeyError(
                f"No step logged `{name}`. Known names: "
                f"{sorted(set().union(*self._layouts))}. Received: "
                f"name={name!r}")
        out = []
        bounds = self._starts[1:] + [len(self._rows)]
        for start, end, names in zip(self._starts, bounds, self._layouts):
            rows = self._rows[start:end]
            if name in names:
                j = names.index(name)
                out.extend(row[j] for row in rows)
            else:
                out.extend(np.full(row.shape[1], np.nan) for row in rows)
        return np.stack(out) if out else np.zeros((0, 0))

    @property
    def nbytes(self):
        """Bytes held by the recorded values."""
        return sum(row.nbytes for row in self._rows)

    def _since(self, start):
        """`(names, [steps, names, replicas] array)` of steps `start:`.

        Only the last layout's steps count if the names changed since.
        """
        first = max(start, self._starts[-1])
        return self._layouts[-1], np.stack(self._rows[first:])

    def __repr__(self):
        names = self._layouts[-1] if self._layouts else ()
        return f"<StepHistory: {len(self)} steps of {list(names)}>"


class ReplicaHistory(keras.callbacks.Callback):
    """Records per-replica series and reports non-finite values.

    Always first in `MirroredModel.fit`'s callback list. Each step's
    `replica_*` vectors go into `mirrored.replica_history["batch"]` (a
    `StepHistory`). At each epoch end it replaces the last step's vectors in
    `logs` by epoch values (sums for samples and non-finite counts, a
    sample-weighted mean for the loss, means otherwise), so that every
    later callback sees those, and appends them to
    `mirrored.replica_history[name]`.
    """

    wants_replica_logs = True
    _wants_wrapper = True  # reads the replicas (`_user_model`)

    def __init__(self, mirrored):
        super().__init__()
        self._mirrored = mirrored
        self._epoch_start = None
        self._step = 0
        self._layouts = {}  # tuple(logs) -> (replica keys, their names)

    def _steps(self):
        history = self._mirrored.replica_history
        steps = history.get("batch")
        if not isinstance(steps, StepHistory):
            steps = history["batch"] = StepHistory()
        return steps

    def on_train_begin(self, logs=None):
        self._step = int(self._mirrored.optimizer.iterations.numpy())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = len(self._steps())

    def _layout(self, logs):
        layout = self._layouts.get(tuple(logs))
        if layout is None:
            keys = tuple(k for k in logs if k.startswith(PREFIX))
            layout = keys, tuple(k[len(PREFIX):] for k in keys)
            self._layouts[tuple(logs)] = layout
        return layout

    def on_train_batch_end(self, batch, logs=None):
        keys, names = self._layout(logs or {})
        if not keys:
            return
        matrix = np.array([logs[k] for k in keys], dtype=np.float64)
        if matrix.ndim != 2:  # a custom step's non-vector `replica_` key
            matrix = matrix.reshape(len(keys), -1)
        self._step += 1
        steps = self._steps()
        if self._epoch_start is None:
            self._epoch_start = len(steps)
        steps.append(names, matrix)
        if "replica_nonfinite" in keys:
            bad = matrix[keys.index("replica_nonfinite")]
            if bad.any():
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
        steps = self._steps()
        start, self._epoch_start = self._epoch_start, None
        if start is None or start >= len(steps) or logs is None:
            return
        names, values = steps._since(start)
        epoch_values = epoch_aggregates(
            tuple(PREFIX + n for n in names), values)
        logs.update(epoch_values)
        history = self._mirrored.replica_history
        for key, value in epoch_values.items():
            history.setdefault(key[len(PREFIX):], []).append(value.tolist())


def epoch_aggregates(keys, values):
    """Epoch values per replica of `keys` from `[steps, keys, replicas]`."""
    stacked = dict(zip(keys, np.moveaxis(values, 1, 0)))
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


def callback_list(mirrored, callbacks, verbose, epochs, steps):
    """`fit`'s callback list: `ReplicaHistory` first, logs routed.

    A `CallbackList` given by the caller is used as it is.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = [ReplicaHistory(mirrored)] + list(callbacks or [])
    return _replica_logs.ReplicaCallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0,
        verbose=verbose, epochs=epochs, steps=steps, model=mirrored)


def route_test_callbacks(mirrored, steps, kwargs):
    """`evaluate`'s and `predict`'s callbacks: the user's model, plain logs.

    Replaces `kwargs["callbacks"]` (a list) by a `ReplicaCallbackList`;
    none given, Keras makes its own list (its progress bar only).
    """
    callbacks = kwargs.get("callbacks")
    if not callbacks or isinstance(callbacks, keras.callbacks.CallbackList):
        return
    verbose = kwargs.get("verbose", "auto")
    kwargs["callbacks"] = _replica_logs.ReplicaCallbackList(
        list(callbacks), add_progbar=verbose != 0, verbose=verbose,
        epochs=1, steps=steps, model=mirrored)
