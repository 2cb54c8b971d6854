"""The optimizer's update traced once for N replicas (the `"strategy"` path).

Stock Keras under a `MirroredStrategy` applies the gradients in a
`merge_call`: for each variable, `strategy.extended.update` runs the
optimizer's `update_step` once per device, so a model with V variables on N
replicas traces V * N updates (measured: 0.70 s of a 2.33 s first step of a
three-layer MLP with Adam on 4 replicas; `benchmarks/bench_first_step.py
--execution strategy` measures it side by side). The gradients are
all-reduced first, so the update is the same function on every replica:
`Update` traces the optimizer's own `apply` once, as a function of one
replica's copies of the variables (passed as arguments), with each Keras
variable backed by its copy during the trace and each variable's update run
once (`_compat.updates_in_place`); every replica calls that
`ConcreteFunction` with its own copies. It is the stock update's code, its
subclasses' own steps included (Nadam's, gradient accumulation, a
`LossScaleOptimizer`), and it assigns in place as the stock update does.
The replacements of `updates_in_place` hold only while the update is
traced, on the replica thread that traces it (the strategy runs its replica
threads one at a time).

It writes each replica's copy directly: Keras's model and slot variables
have aggregation `"none"` (a replica's write is its own), and the step
counter (`"only_first_replica"`) gets the same value on every replica.

It serves Keras's built-in step whether or not the replica's forward pass is
traced once (`_one_trace`), not a model's own `train_step` (whose
optimizer's `apply` runs inside the user's step, traced per replica). That
`apply` writes the replica's copies the same way (`on_copies`, from
`own_step`), with no `merge_call` inside it.

Where it cannot serve, the step applies the gradients as stock Keras does
and says why once (logger `keras_mirror`, INFO; it is only a start-up
cost). Decided before tracing (`reason_against`): `run_eagerly`, an
optimizer not yet built, a missing gradient, a variable with another
aggregation or one not copied on every replica; and from the trace, before
any replica runs it: an update that reads state it was not given (a
learning-rate schedule with its own variable). A trace that fails is a
failure, not a fallback: it raises.
"""

import contextlib
import logging

import tensorflow as tf

from keras_mirror import _compat

_WRITABLE = ("none", "only_first_replica")
CAPTURES = "the update reads state it was not given"


def reason_against(optimizer, variables, grads, strategy):
    """Why the update cannot be traced once (None: it can)."""
    if not getattr(optimizer, "built", False):
        return "the optimizer is not built"
    if len(grads) != len(variables) or any(
            not isinstance(g, (tf.Tensor, tf.IndexedSlices)) for g in grads):
        return "a gradient is missing"
    if tf.executing_eagerly():
        return "the step runs eagerly (`run_eagerly=True`)"
    local = len(strategy.extended.worker_devices)
    for v in list(variables) + list(optimizer.variables):
        if getattr(v, "aggregation", "none") not in _WRITABLE:
            return f"variable {v.path!r} has aggregation {v.aggregation!r}"
        copies = strategy.experimental_local_results(_compat.backing(v))
        if len(copies) != local:
            return f"variable {v.path!r} is not copied on every replica"
    return None


class Update:
    """`update(grads, finite=None)` in a replica's context.

    Applies the all-reduced `grads` to the replica's copies of `variables`
    and of the optimizer's variables with the optimizer's `apply`, traced
    once for all replicas. With `finite` (a boolean scalar), a False keeps
    every copy as it was (the `"skip_step"` and `"raise"` modes).
    """

    def __init__(self, optimizer, variables, strategy):
        self.optimizer = optimizer
        self.variables = list(variables)
        self._strategy = strategy
        self._everything = self.variables + list(optimizer.variables)
        self.function = tf.function(self._update, autograph=False)
        self._concrete = None
        self._signature = None

    def _update(self, copies, grads, finite=None):
        with on_copies(self.optimizer, self._everything, copies):
            if finite is None:
                self.optimizer.apply(grads, self.variables)
            else:
                tf.cond(finite,
                        lambda: self._applied(grads),
                        lambda: tf.constant(False))

    def _applied(self, grads):
        """The `cond` branch that applies `grads` (True: applied)."""
        self.optimizer.apply(grads, self.variables)
        return tf.constant(True)

    def __call__(self, grads, finite=None):
        copies = replica_copies(self._strategy, self._everything)
        self._concrete(copies, list(grads), finite)

    def prepare(self, grads, finite=None):
        """Traces the update for these arguments (once); why the trace
        cannot serve every replica, or None (then call it)."""
        if self._concrete is not None:
            return None
        copies = replica_copies(self._strategy, self._everything)
        specs = (copies, [_spec(g, v) for g, v in zip(grads, copies)],
                 None if finite is None else tf.TensorSpec([], tf.bool))
        concrete = self.function.get_concrete_function(*specs)
        if concrete.captured_inputs:
            return CAPTURES
        self._concrete = concrete
        self._signature = (_kinds(grads), finite is None)
        return None

    def serves(self, optimizer, variables, grads, finite):
        """Whether this trace takes these arguments."""
        if optimizer is not self.optimizer or len(variables) != len(
                self.variables) or any(a is not b for a, b in zip(
                    variables, self.variables)):
            return False
        if self._concrete is None:
            return True
        return self._signature == (_kinds(grads), finite is None)


def replica_copies(strategy, variables):
    """The current replica's copy of each of `variables` (a variable not
    copied per replica is its own copy)."""
    ctx = tf.distribute.get_replica_context()
    replica = int(tf.get_static_value(ctx.replica_id_in_sync_group))
    out = []
    for v in variables:
        copies = strategy.experimental_local_results(_compat.backing(v))
        out.append(copies[replica % len(copies)])
    return out


@contextlib.contextmanager
def on_copies(optimizer, variables, copies):
    """Within the block, each of `variables` is backed by its copy in
    `copies` and `optimizer` updates each variable once, in place, without
    `tf.distribute` (`_compat.updates_in_place`): its `apply` writes these
    copies, and no `merge_call` is made (none may be inside a `cond`
    branch, where gradient accumulation and `LossScaleOptimizer` update).
    """
    backings = [_compat.backing(v) for v in variables]
    try:
        for v, copy in zip(variables, copies):
            _compat.set_backing(v, copy)
        with _compat.updates_in_place(optimizer):
            yield
    finally:
        for v, backing in zip(variables, backings):
            _compat.set_backing(v, backing)


def _spec(grad, variable):
    """The argument spec of `grad`, the gradient of `variable`: a sparse
    gradient (an `Embedding`'s) with any number of rows, so that the
    replicas' calls (whose row counts differ) share the trace."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlicesSpec(
            shape=variable.shape, dtype=grad.dtype,
            indices_dtype=grad.indices.dtype,
            dense_shape_dtype=None if grad.dense_shape is None
            else grad.dense_shape.dtype, indices_shape=[None])
    return tf.TensorSpec(grad.shape, grad.dtype)


def _kinds(grads):
    """What a trace's gradients must match: dtype and dense or sparse."""
    return tuple((g.dtype, isinstance(g, tf.IndexedSlices)) for g in grads)


def apply(mirrored, grads, variables, finite=None):
    """Applies `grads` with one trace for all replicas; False where it
    cannot (the caller then applies them as stock Keras does)."""
    optimizer = mirrored._inner.optimizer
    state = mirrored._step_state
    reason = reason_against(optimizer, variables, grads, mirrored._strategy)
    # One trace serves every replica and every later trace of the step (a
    # retrace for a new batch shape): it holds no state of its graph.
    update = state.one_update_last
    if reason is None and (update is None or not update.serves(
            optimizer, variables, grads, finite)):
        update = Update(optimizer, variables, mirrored._strategy)
        reason = update.prepare(grads, finite)
        state.one_update_last = None if reason else update
    state.one_update_reason = reason
    if reason is not None:
        if state.first_time("one update", reason):
            logging.getLogger("keras_mirror").info(
                "keras-mirror applies the gradients as stock Keras does (the "
                "optimizer's update traced per replica), because %s.",
                reason)
        return False
    update(grads, finite)
    return True
