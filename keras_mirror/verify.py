"""`mirrored.verify(...)`: a few steps here and on one device, compared.

keras-mirror cannot see inside every model's code (a hand-written batch sum,
a loss over the whole batch), so `verify` checks it on the user's own data
before a long run. It builds the model (as `fit` would), then:

1. takes a snapshot of every piece of state a step changes: the model's
   variables (weights, seed generators' state), every optimizer's variables
   (slots and `iterations`), the metrics' variables, the per-replica
   records;
2. runs `steps` steps of `mirrored.fit` and reads the state they left;
3. restores the snapshot and runs the same steps through plain Keras's
   `model.fit` on the user's own model object, outside any strategy, on one
   device (no copy of the model: the same object, the same optimizer);
4. compares, and restores the snapshot again.

Both runs see the same global batches (`shuffle=False` unless given; a
Python generator is read once and replayed to both). In `batch=
"per_replica"` mode the one-device run gets the joined global batches.
"""

import itertools
import math

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.distribute import _homes
from keras_mirror.distribute import _virtual_shards
from keras_mirror.wrapper import _arguments
from keras_mirror.wrapper import _compile
from keras_mirror.wrapper import _first
from keras_mirror.wrapper import _grouping
from keras_mirror.wrapper import _inputs
from keras_mirror.wrapper import _rendering
from keras_mirror.wrapper import _validate


class VerifyReport:
    """What `MirroredModel.verify` found: the wrapper against one device.

    Attributes:
        exact: bool. Every compared variable within `tolerance` (absolute)
            and every logged value within `tolerance` (relative, at least
            absolute).
        max_weight_diff: float. The largest absolute difference over the
            model's variables (weights, seed generators' state) and every
            optimizer's variables after the steps.
        worst_variable: str or None. The path of the variable that has it.
        variable_diffs: dict. `{path: max absolute difference}`, every
            compared variable.
        logs: list of `(step, key, wrapper value, one-device value)`: the
            values Keras logged after each step (`step` from 1), and the
            epoch's final values (`step` `"end"`, with validation keys).
        steps: int. Steps run (fewer than asked when the input ran out).
        tolerance: float.

    `print(report)` or `report.summary()` prints it as tables in the style
    of Keras's `model.summary()`.
    """

    def __init__(self, variable_diffs, logs, steps, tolerance):
        self.variable_diffs = variable_diffs
        self.logs = logs
        self.steps = steps
        self.tolerance = tolerance
        worst = max(variable_diffs, key=variable_diffs.get, default=None)
        self.worst_variable = worst
        self.max_weight_diff = variable_diffs[worst] if worst else 0.0
        self.exact = self.max_weight_diff <= tolerance and all(
            _log_diff(a, b) <= tolerance for _, _, a, b in logs)

    def summary(self, print_fn=None, line_length=None):
        """Prints the result and the logged values side by side."""
        verdict = "exact" if self.exact else "NOT exact"
        _rendering.table(
            f"Verify: {verdict} (tolerance {self.tolerance:g})",
            ["Check", "Value"], [
                ["Steps compared", str(self.steps)],
                ["Max weight difference", f"{self.max_weight_diff:.3g}"],
                ["Worst variable", str(self.worst_variable)],
                ["Variables compared", str(len(self.variable_diffs))],
            ], print_fn=print_fn, width=line_length)
        _rendering.table(
            "Logged values: wrapper vs one device",
            ["Step", "Log", "Wrapper", "One device", "Difference"],
            [[str(step), key, f"{a:.7g}", f"{b:.7g}",
              f"{_log_diff(a, b):.3g}"] for step, key, a, b in self.logs],
            print_fn=print_fn, justify=["left", "left", "right", "right",
                                        "right"], width=line_length)

    def __str__(self):
        lines = []
        self.summary(print_fn=lines.append)
        return "\n".join(lines)

    def __repr__(self):
        return (f"<VerifyReport exact={self.exact} max_weight_diff="
                f"{self.max_weight_diff:.3g} worst_variable="
                f"{self.worst_variable!r} steps={self.steps}>")


def verify(mirrored, x, y=None, batch_size=None, steps=3, tolerance=1e-5,
           **fit_kwargs):
    """`MirroredModel.verify`: see the module docstring.

    `fit_kwargs` go to both runs' `fit` (`sample_weight`, `class_weight`,
    `validation_data`, `callbacks`, ...); `epochs`, `steps_per_epoch` and
    `verbose` are verify's own.
    """
    virtual = _virtual_shards.applies(mirrored, x)
    if virtual and mirrored.num_workers > 1:
        raise ValueError(
            "`verify` compares with one device, which reads every virtual "
            "shard; on a cluster each worker reads only its own. Run it in "
            "one process with the same `virtual_shards`. "
            f"Received: worker_input='shard' on {mirrored.num_workers} "
            "workers")
    _check(x, steps, tolerance, fit_kwargs, virtual)
    steps, tolerance = int(steps), float(tolerance)
    _compile.require_compiled(mirrored, "verify")
    x = _replayable(x, steps * (mirrored.num_replicas
                                if mirrored.batch_mode == "per_replica"
                                else 1))
    # With virtual shards, one device trains on the global batches they
    # make (in one process: every shard), not on the pipeline's own.
    source = _virtual_shards.fit_dataset(mirrored, x) if virtual else x
    first = _first.First(source)
    reference_x, reference_batch = _grouping.adapt(
        mirrored, source, batch_size, first)
    _, example = _inputs.prepare(mirrored, reference_x, y,
                                 fit_kwargs.get("sample_weight"),
                                 reference_batch, None, first)
    _compile.ensure_built(mirrored, reference_x, example, y,
                          training=False)
    state = _Snapshot(mirrored)
    fit_kwargs.setdefault("shuffle", False)
    try:
        state.scratch()
        ours = _run(mirrored.fit, x, y, batch_size, steps, fit_kwargs)
        after = state.read()
        state.restore()
        with tf.device(mirrored.devices[0]):
            theirs = _run(mirrored.model.fit, reference_x, y,
                          reference_batch, steps, fit_kwargs)
        reference = state.read()
    finally:
        state.restore()
    diffs = {path: _diff(a, b) for path, a, b in zip(
        state.paths, after, reference)}
    return VerifyReport(diffs, _side_by_side(ours, theirs),
                        min(len(ours.steps), len(theirs.steps)), tolerance)


def _check(x, steps, tolerance, fit_kwargs, virtual):
    if not virtual:
        _validate.refuse_unread("x", x)
    if not _arguments.is_int(steps) or steps < 1:
        raise ValueError(
            f"`steps` must be a positive integer. Received: steps={steps!r}")
    if not _arguments.is_number(tolerance) or \
            not math.isfinite(tolerance) or tolerance < 0:
        raise ValueError(
            "`tolerance` must be a finite non-negative number. "
            f"Received: tolerance={tolerance!r}")
    _check_callbacks(fit_kwargs.get("callbacks"))
    for name in ("epochs", "steps_per_epoch", "verbose", "initial_epoch"):
        if name in fit_kwargs:
            raise ValueError(
                f"`verify` runs `steps` steps of one epoch, silently: "
                f"`{name}` is its own. Pass `steps=...` instead. "
                f"Received: {name}={fit_kwargs[name]!r}")


def _callback_items(callbacks):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    return list(callbacks or [])


def _check_callbacks(callbacks):
    """Refuses what `fit` cannot take, before anything runs or is touched.

    A `StepBackup` is refused: verify runs two scratch trainings that must
    not write (or resume from) the user's backup directory.
    """
    _arguments.check_callbacks(callbacks)
    for c in _callback_items(callbacks):
        if any(t.__name__ == "StepBackup" for t in type(c).__mro__):
            raise ValueError(
                "`verify` runs two scratch trainings and cannot take a "
                "`StepBackup` (it would write or resume the backup). "
                "Remove it from `callbacks`. "
                f"Received: callbacks={callbacks!r}")


def _replayable(x, elements):
    """`x`, or a Python generator's first `elements` read once, as a
    dataset that both runs can iterate."""
    if not _inputs.is_generator(x):
        return x
    items = list(itertools.islice(x, elements))
    if not items:
        raise ValueError(
            "`x` must yield at least one batch. Received: an empty "
            f"{type(x).__name__}")
    signature = tf.nest.map_structure(
        lambda a: tf.TensorSpec((None,) + np.shape(a)[1:],
                                tf.as_dtype(np.asarray(a).dtype)), items[0])
    return tf.data.Dataset.from_generator(lambda: iter(items),
                                          output_signature=signature)


class _Recorder(keras.callbacks.Callback):
    """The logs Keras gives callbacks, as floats, step by step."""

    def __init__(self):
        super().__init__()
        self.steps, self.end = [], {}

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(_floats(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.end = _floats(logs)


def _floats(logs):
    out = {}
    for key, value in (logs or {}).items():
        value = np.asarray(value)
        if value.ndim == 0 and np.issubdtype(value.dtype, np.number):
            out[key] = float(value)
    return out


def _run(fit, x, y, batch_size, steps, fit_kwargs):
    recorder = _Recorder()
    kwargs = dict(fit_kwargs)
    kwargs["callbacks"] = [recorder] + _callback_items(
        kwargs.get("callbacks"))
    fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=steps,
        verbose=0, **kwargs)
    return recorder


def _side_by_side(ours, theirs):
    rows = []
    for step, (a, b) in enumerate(zip(ours.steps, theirs.steps), 1):
        rows += [(step, k, a.get(k, math.nan), v) for k, v in b.items()]
    rows += [("end", k, ours.end.get(k, math.nan), v)
             for k, v in theirs.end.items()]
    return rows


def _diff(a, b):
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    a, b = a.astype(np.float64), b.astype(np.float64)
    same_nan = np.isnan(a) & np.isnan(b)
    return float(np.max(np.where(same_nan, 0.0, np.abs(a - b))))


def _log_diff(a, b):
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(1.0, abs(b))


class _Snapshot:
    """Every variable a training step changes, and the wrapper's records."""

    def __init__(self, mirrored):
        self._mirrored = mirrored
        inner = mirrored.model
        compared = _homes.unique([*inner.variables] + [
            v for opt in _homes.optimizers_of(inner) for v in opt.variables])
        generator = _compat.global_seed_generator()
        if generator is not None:
            compared = _homes.unique(compared + [generator.state])
        self.compared = compared
        self.paths = _paths(compared)
        # A model's own step: the wrapper's step counter is not the model's.
        self._all = _homes.unique(compared + list(inner.metrics_variables)
                            + list(mirrored.optimizer.variables))
        self._values = [np.array(v.numpy()) for v in self._all]
        # The wrapper's run records into a scratch dict (`scratch`); the
        # user's own records are put back untouched.
        self._replica_history = mirrored.replica_history
        self._last = mirrored._step_state.last_replica_logs
        self._history = inner.__dict__.get("history")
        self._stop = getattr(inner, "stop_training", False)

    def scratch(self):
        """Gives the wrapper's run empty per-replica records."""
        object.__setattr__(self._mirrored, "replica_history", {})

    def read(self):
        """The compared variables' current values."""
        return [np.array(v.numpy()) for v in self.compared]

    def restore(self):
        for variable, value in zip(self._all, self._values):
            variable.assign(value)
        mirrored = self._mirrored
        object.__setattr__(mirrored, "replica_history", self._replica_history)
        mirrored._step_state.last_replica_logs = self._last
        inner = mirrored.model
        if self._history is None:
            inner.__dict__.pop("history", None)
        else:
            object.__setattr__(inner, "history", self._history)
        inner.stop_training = self._stop


def _paths(variables):
    """Each variable's path, numbered when two share one."""
    counts, out = {}, []
    for v in variables:
        path = getattr(v, "path", None) or v.name
        counts[path] = counts.get(path, 0) + 1
        out.append(path if counts[path] == 1 else f"{path}#{counts[path]}")
    return out
