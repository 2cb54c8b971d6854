"""One trace for N replicas: a replica's work traced once, run on every device.

Keras's built-in step runs the same forward pass, loss and gradients on
every replica; only the shard, the replica's place in the batch and the
copy of the variables differ. `replica_work` traces that work once, as a
function of the variables' values (`_xla.replica_function`, with or without
XLA), the shard and the replica's id, size and offset as tensors, and every
replica calls the same `ConcreteFunction` under its own device.

A `tf.function` would not do on the `"strategy"` path: under a
`MirroredStrategy` over several devices TensorFlow retraces a function for
each device it is called under (`_retrace_functions_for_each_device`), so a
`ConcreteFunction`, traced once with the shard's leading dimension unknown,
is what every replica calls. Its ops carry no device; each call runs on the
device of its replica's scope.

Where the work cannot be traced once, the step traces it per replica, and
the reason is logged once (logger `keras_mirror`, INFO) and kept in the
wrapper's `StepState` (the trace is only a start-up cost). Decided before
tracing: a model's own `train_step`, BatchNormalization with global
statistics, `run_eagerly`, one local replica without XLA, and sparse or
ragged input (`composite`). Noted by keras-mirror's own code while the
single trace is made (`note`; no exception, no error text of
TensorFlow's): a masked output (its loss shares need every replica's count,
an all-reduce), a cross-replica call of `replica_context()` inside the
forward pass (no replica can wait for another inside one trace) and, with
XLA, a pass that updates state outside the model. That trace is then
dropped before any replica runs it (`Traced.prepare`), and the replica
step takes its per-replica branch.

`decide` is the one decision of how a replica's work is traced, read by
every path: once for every replica or per replica, and with XLA
(`_xla`) or without, each reason said once:

- XLA runs where the wrapped model was compiled with `jit_compile` on and
  not `run_eagerly`, except for a model's own `train_step` (its
  optimizer's `apply` all-reduces inside the step), BatchNormalization
  with global statistics (an all-reduce in the forward pass), or once a
  trace noted a reason (`turn_off`); each reason is a `UserWarning`, once
  per wrapper.
- One trace serves every replica of Keras's built-in step, except for a
  model's own `train_step`, `run_eagerly`, BatchNormalization with global
  statistics (logged once, INFO) or once a trace noted a reason; with one
  local replica (one device, or one process of a cluster) only for XLA,
  whose compiled function it is (one trace has nothing to share there).

The reasons a trace notes (`replica_context.note`) are kept in the
wrapper's `StepState` (`one_trace_off`, `xla_off`): the decision is made
anew from the compile and those records at each call, so a new compile
decides again.
"""

import collections
import functools
import logging
import warnings

import tensorflow as tf

from keras_mirror.replica_context import note  # noqa: F401 (`_one_trace.note`)
from keras_mirror.replica_context import outside_one_trace
from keras_mirror.steps import _batchnorm
from keras_mirror.steps import _xla
from keras_mirror.steps import arithmetic

SPARSE = "a shard is sparse or ragged"

Plan = collections.namedtuple("Plan", ["one_trace", "xla"])


def decide(mirrored):
    """`Plan(one_trace, xla)` for the wrapper's next replica step."""
    inner, state = mirrored._inner, mirrored._step_state
    eager = bool(getattr(inner, "run_eagerly", False))
    forward = _batchnorm.kinds(mirrored).forward_collectives
    xla = bool(getattr(inner, "compiled", False) and not eager
               and inner.jit_compile)
    if xla:
        against = (state.xla_off
                   or (_xla.OWN_STEP if mirrored._custom_step else None)
                   or (_batchnorm.FORWARD_COLLECTIVES if forward else None))
        if against is not None:
            _warn_once(mirrored, against)
            xla = False
    one = not (mirrored._custom_step or state.one_trace_off or eager)
    if one and forward:
        _log_once(mirrored, _batchnorm.FORWARD_COLLECTIVES)
        one = False
    if one and (len(mirrored._devices) == 1 or mirrored._multi_worker):
        one = xla
    return Plan(one, xla)


def turn_off(mirrored, reason):
    """Traces per replica from now on, and without XLA unless the reason
    is a sparse or ragged shard (XLA retraces per shape), saying why once.
    """
    state = mirrored._step_state
    if reason != SPARSE and decide(mirrored).xla:
        state.xla_off = reason
        _warn_once(mirrored, reason)
    state.one_trace_off = reason
    _log_once(mirrored, reason)


def _warn_once(mirrored, reason):
    if not mirrored._step_state.first_time("xla", reason):
        return
    warnings.warn(
        "The wrapped model was compiled with `jit_compile=True`, but "
        f"keras-mirror runs its replica step without XLA because {reason}. "
        "Received: jit_compile=True", UserWarning, stacklevel=4)


def _log_once(mirrored, reason):
    """Says once per wrapper and reason why the work is traced per replica.
    """
    if not mirrored._step_state.first_time("one trace", reason):
        return
    logging.getLogger("keras_mirror").info(
        "keras-mirror traces the replica step per replica, not once for "
        "all replicas, because %s.", reason)


class Trial:
    """Why one trace cannot serve a replica's work, noted while it is made.

    Owned by its `Traced`; the replica context of the trace holds it
    (`ReplicaContext(traced_once=trial)`), so that `replica_context.note`
    reaches it from anywhere in the work.
    """

    def __init__(self):
        self.reasons = None  # a list while the trace is made

    def note(self, reason):
        if self.reasons is None:
            raise outside_one_trace(reason)
        self.reasons.append(reason)


def replica_work(mirrored, body, shards):
    """`_xla.replica_function` of `body`, traced once (`Traced`).

    `body(trial, *args)`: `trial` is the `Trial` of this trace, for the
    replica context the body makes.

    Compiled with XLA when the model's `jit_compile` asks for it
    (`decide`). `shards` are the positions (after the two lists of
    variable values) of the arguments whose leading dimension is the
    shard's rows, which differ between replicas.
    """
    jit = decide(mirrored).xla
    trial = Trial()
    function = _xla.replica_function(
        mirrored._inner, functools.partial(body, trial), jit, trial.note)
    if jit:
        _xla.remember(mirrored, function)
    traced = Traced(function, [i + 2 for i in shards], jit, trial)
    mirrored._step_state.one_trace_last = traced
    return traced


def finisher(mirrored, keys):
    """A replica's gradient guard and statistics, traced once.

    `finish(grads, shard_loss, rows, sw, start)` returns
    `(arithmetic.zero_if_empty(grads, rows), arithmetic.compute_stats(...))`
    for dense gradients: outside XLA (the step clock is a `tf.timestamp`),
    one call per replica instead of a `cond` and the statistics' ops traced
    per replica. Sparse gradients (an `Embedding`'s `tf.IndexedSlices`)
    are guarded per replica, as without the single trace.
    """
    def finish(grads, shard_loss, rows, sw, start):
        grads = arithmetic.zero_if_empty(grads, rows)
        return grads, arithmetic.compute_stats(keys, start, grads,
                                               shard_loss, rows, sw)

    traced = Traced(tf.function(finish, autograph=False), shards=[3])

    def call(grads, shard_loss, rows, sw, start):
        rows = tf.cast(rows, tf.int32)
        args = (grads, shard_loss, rows, sw, start)
        if any(isinstance(g, tf.IndexedSlices) for g in grads) or \
                traced.prepare(*args) is not None:
            return finish(*args)
        return traced(*args)

    return call


class Traced:
    """A function traced once, then called as that trace by every replica.

    `prepare(*args)` traces it on its first call (the shards' row counts
    unknown) and returns why one trace cannot serve the work (`note`d while
    tracing, or sparse or ragged shards), or None; the caller then calls
    it. Sparse or ragged shards are not traced once (measured: weights 0.06
    away from one device's with a sparse input): with XLA the function is
    called as a `tf.function`, retraced per shape, as before the single
    trace.
    """

    def __init__(self, function, shards, jit=False, trial=None):
        self.function = function
        self._trial = trial or Trial()
        self._shards = set(shards)
        self._concrete = None
        self._jit = jit
        self.reason = None

    def prepare(self, *args):
        """Traces the function for `args` (once); why one trace cannot
        serve them, or None."""
        if self._concrete is not None or self.reason is not None:
            return self.reason
        sparse = composite(args)
        if sparse and not self._jit:
            self.reason = SPARSE
            return self.reason
        self._trial.reasons = reasons = []
        try:
            if sparse:
                concrete = self.function.get_concrete_function(*args)
            else:
                concrete = self.function.get_concrete_function(*[
                    _specs(a, i in self._shards) for i, a in enumerate(args)])
        finally:
            self._trial.reasons = None
        if reasons:
            self.reason = reasons[0]
        elif not sparse:
            self._concrete = concrete
        return self.reason

    def __call__(self, *args):
        if self._concrete is None:  # sparse or ragged shards, with XLA
            return self.function(*args)
        return self._concrete(*args)


def _specs(structure, shard):
    """Each leaf's type spec; a shard's with its row count unknown.

    Sparse and ragged shards (`tests/steps/test_sparse.py`) keep their
    kind.
    """
    def spec(t):
        if t is None:
            return None
        if not isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
            t = tf.convert_to_tensor(t)
        shape = t.shape
        if shard and shape.rank:
            shape = tf.TensorShape([None]).concatenate(shape[1:])
        if isinstance(t, tf.SparseTensor):
            return tf.SparseTensorSpec(shape, t.dtype)
        if isinstance(t, tf.RaggedTensor):
            return tf.RaggedTensorSpec(shape, t.dtype, t.ragged_rank,
                                       t.row_splits.dtype)
        return tf.TensorSpec(shape, t.dtype)

    return tf.nest.map_structure(spec, structure, expand_composites=False)


def composite(data):
    """Whether any leaf of the step's input is sparse or ragged."""
    return any(isinstance(t, (tf.SparseTensor, tf.RaggedTensor))
               for t in tf.nest.flatten(data))


def run(mirrored, traced, plain, data=None):
    """`traced()` (the step with the work traced once), else `plain()`.

    Decided here, before tracing, from the wrapper and the input (sparse or
    ragged leaves: `composite`); what only the trace can show is noted
    while tracing, and the replica step then takes its per-replica branch
    (`Traced.prepare`).
    """
    plan = decide(mirrored)
    if plan.one_trace and composite(data) and not plan.xla:
        turn_off(mirrored, SPARSE)
        plan = decide(mirrored)
    return traced() if plan.one_trace else plain()
