"""Routing per-replica vectors through Keras callbacks.

`train_step` returns, beside the usual global keys, vectors of length
`num_replicas` under the keys `replica_*` (and `val_replica_*` after
validation). A project that only adds the wrap must see the logs it saw
before: `ReplicaCallbackList` hands every callback the logs without the
vectors (so `History`, `CSVLogger`, `ProgbarLogger`, Keras's `TensorBoard`
and the user's own callbacks get exactly plain Keras's keys), except the
callbacks that opt in with the class attribute `wants_replica_logs = True`:
`ReplicaHistory`, `ReplicaTensorBoard`, and any user callback that sets it.
"""

import bisect
import collections.abc
import functools
import operator
import re
import sys
import warnings
import weakref

import keras
import numpy as np

from keras_mirror import errors

PREFIX = "replica_"
# Keras prefixes validation logs with `val_`.
_PREFIXES = (PREFIX, "val_" + PREFIX)
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
    return {k: v for k, v in logs.items() if not k.startswith(_PREFIXES)}


def wants_replica_logs(callback):
    """Whether `callback` opted in to the per-replica vectors.

    A callback opts in with a true class (or instance) attribute
    `wants_replica_logs`; every other callback sees plain Keras's logs.
    """
    return bool(getattr(callback, "wants_replica_logs", False))


class ReplicaCallbackList(keras.callbacks.CallbackList):
    """A `CallbackList` that gives the replica vectors only to opted-in ones.

    Callbacks with `wants_replica_logs = True` get the logs with the
    `replica_*` vectors; all others (`History`, `CSVLogger`, the progress
    bar, Keras's `TensorBoard`, yours by default) get the logs plain Keras
    would give them.
    """

    _notice = ""  # the first-step line on screen, if any
    _first_step = False  # until the first step of a `fit` ends

    def _dispatch(self, hook, *args, logs=None):
        stripped = None
        for callback in self.callbacks:
            if wants_replica_logs(callback):
                cb_logs = logs
            else:
                if stripped is None:
                    stripped = strip(logs)
                cb_logs = stripped
            getattr(callback, hook)(*args, logs=cb_logs)

    def on_train_begin(self, logs=None):
        self._first_step = True
        super().on_train_begin(logs)

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if self._first_step and not self._notice:
            self._notice = first_step_notice(self.callbacks, self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self._first_step:
            self._first_step = False
            if self._notice:
                _erase(self._notice)
                self._notice = ""
            function = getattr(self.model, "train_function", None)
            if function is not None:
                _TRACED[self.model] = weakref.ref(function)
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


# model -> weak reference to the train function whose first step ran.
_TRACED = weakref.WeakKeyDictionary()
NOTICE = "tracing the training step (once per compile)"


def first_step_notice(callbacks, model):
    """Shows one progress-bar line while the first step traces, or "".

    The first step of a new train function traces and compiles the graph,
    which takes seconds (15 s for the demo on 2 shared cores) before Keras's
    progress bar shows anything. With a `verbose=1` progress bar this prints
    `0/steps ━━━━ tracing the training step ...` in the bar's own style,
    without a newline: the bar's first update overwrites it. Returns the
    text printed ("" when nothing was).
    """
    bars = [c for c in callbacks
            if isinstance(c, keras.callbacks.ProgbarLogger)
            and c.verbose == 1]
    function = getattr(model, "train_function", None)
    seen = _TRACED.get(model) if model is not None else None
    if not bars or function is None or (seen and seen() is function):
        return ""
    if not keras.config.is_interactive_logging_enabled():
        return ""
    target = bars[0].target
    if target:
        text = (f"\x1b[1m{0:>{len(str(target))}}/{target}\x1b[0m "
                f"\x1b[37m{'━' * 20}\x1b[0m {NOTICE}")
    else:
        text = f"{0:>7}/Unknown {NOTICE}"
    sys.stdout.write(text)
    sys.stdout.flush()
    return text


def _erase(text):
    """Blanks the notice's line for the progress bar's first update."""
    visible = re.sub(r"\x1b\[[0-9;]*m", "", text)
    sys.stdout.write("\r" + " " * len(visible) + "\r")
    sys.stdout.flush()


def unpack(logs, keys=STAT_KEYS):
    """`logs` with the packed statistics split into `replica_*` vectors.

    `keys` name the packed matrix's columns (`MirroredModel(replica_stats=
    False)` packs fewer).
    """
    if not isinstance(logs, dict) or PACKED not in logs:
        return logs
    logs = dict(logs)
    columns = np.ascontiguousarray(np.asarray(logs.pop(PACKED)).T)
    if len(columns) != len(keys):
        raise ValueError(
            f"The packed per-replica statistics have {len(columns)} "
            f"columns; expected one per key of {keys}.")
    for key, column in zip(keys, columns):
        logs[key] = column
    return logs


def unpacking(function, keys=STAT_KEYS):
    """Wraps a Keras train function so that its logs come unpacked."""
    if function is None or getattr(function, "_unpacks_replica_stats",
                                   False):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        return unpack(function(*args, **kwargs), keys)

    call._unpacks_replica_stats = True
    return call


def _numpy(logs):
    if logs is None:
        return None
    out = {}
    for k, v in logs.items():
        if type(v) is not np.ndarray or v.ndim == 0:  # vectors pass as is
            if hasattr(v, "numpy"):
                v = v.numpy()
            if isinstance(v, np.generic) or (
                    isinstance(v, np.ndarray) and v.ndim == 0):
                v = float(v)
        out[k] = v
    return out


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
