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
the reason is logged once (logger `keras_mirror`, INFO) and kept (the trace
is only a start-up cost). Decided before tracing: a model's own `train_step`,
synchronized BatchNormalization, `run_eagerly`, one local replica without
XLA, and sparse or ragged input (`composite`). Signalled by keras-mirror's
own code the moment the trace meets it, before TensorFlow does (`Unshared`,
never an error message of TensorFlow's): a masked output (its loss shares
need every replica's count, an all-reduce) and a cross-replica call of
`replica_context()` inside the forward pass (no replica can wait for
another inside one trace).
"""

import logging

import tensorflow as tf

from keras_mirror.replica_context import InTracedOnce
from keras_mirror.steps import _batchnorm
from keras_mirror.steps import _xla
from keras_mirror.steps import arithmetic

SPARSE = "a shard is sparse or ragged"
REDUCES = InTracedOnce.reason


def enabled(mirrored):
    """Whether the built-in step's replica work is traced once.

    Not for a model's own `train_step` (its optimizer all-reduces inside
    the step), BatchNormalization whose statistics are the global batch's
    (synchronized, or plain with `batchnorm="global"`: an all-reduce in the
    forward pass, logged once), `run_eagerly`, or once a trace failed;
    with one local replica (one device, or a multi-worker process) only
    for XLA, whose compiled function it is (one trace has nothing to share
    there).
    """
    if mirrored._custom_step or mirrored.__dict__.get("_one_trace_off"):
        return False
    if getattr(mirrored._inner, "run_eagerly", False):
        return False
    if _batchnorm.needs_forward_collectives(
            mirrored._inner, getattr(mirrored, "_batchnorm", "global")):
        _log_once(mirrored, _batchnorm.FORWARD_COLLECTIVES)
        return False
    if len(mirrored.devices) == 1 or mirrored._multi_worker:
        return _xla.enabled(mirrored)
    return True


def replica_work(mirrored, body, shards):
    """`_xla.replica_function` of `body`, traced once (`Traced`).

    Compiled with XLA when the model's `jit_compile` asks for it
    (`_xla.enabled`). `shards` are the positions (after the two lists of
    variable values) of the arguments whose leading dimension is the
    shard's rows, which differ between replicas.
    """
    jit = _xla.enabled(mirrored)
    function = _xla.replica_function(mirrored._inner, body, jit)
    if jit:
        _xla.remember(mirrored, function)
    traced = Traced(function, [i + 2 for i in shards], jit)
    mirrored.__dict__["_one_trace_last"] = traced
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
        if any(isinstance(g, tf.IndexedSlices) for g in grads):
            return finish(grads, shard_loss, rows, sw, start)
        return traced(grads, shard_loss, rows, sw, start)

    return call


class Unshared(Exception):
    """Raised before tracing work that one trace cannot serve exactly.

    The reason is the class's (`reason`): Keras re-raises an exception from
    a layer's `call` as a new one of the same class with its own text.
    """

    reason = SPARSE




class Traced:
    """A function traced on its first call, then called as that trace.

    Sparse or ragged shards are not traced once (measured: weights 0.06
    away from one device's with a sparse input on in_graph): with XLA the
    function is called as a `tf.function` (as before the single trace),
    without it `Unshared` sends the step back to per-replica traces.
    """

    def __init__(self, function, shards, jit=False):
        self.function = function
        self._shards = set(shards)
        self._concrete = None
        self._jit = jit

    def tracing_count(self):
        """How many times the function was traced (1 once it ran)."""
        return self.function.experimental_get_tracing_count()

    def __call__(self, *args):
        composite = any(isinstance(t, (tf.SparseTensor, tf.RaggedTensor))
                        for t in tf.nest.flatten(args))
        if composite and self._jit:
            return self.function(*args)
        if composite:
            raise Unshared(SPARSE)
        if self._concrete is None:
            specs = [_specs(a, i in self._shards) for i, a in enumerate(args)]
            self._concrete = self.function.get_concrete_function(*specs)
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

    Decided before tracing where the input says it (sparse or ragged
    leaves: `composite`); a trace that meets what it cannot serve raises
    keras-mirror's own `Unshared` or `_xla.Unsupported`, which turns the
    single trace off for this wrapper, and the step is built by `plain()`.
    """
    if enabled(mirrored) and composite(data) and not _xla.enabled(
            mirrored):
        turn_off(mirrored, SPARSE)
    if not enabled(mirrored):
        _xla.enabled(mirrored)  # warns once why XLA is off, if it was asked
        return plain()
    try:
        return traced()
    except _xla.Unsupported as e:
        turn_off(mirrored, str(e))
    except (Unshared, InTracedOnce) as e:
        turn_off(mirrored, type(e).reason)
    return plain()


def turn_off(mirrored, reason):
    """Traces per replica from now on (and without XLA, saying why)."""
    if _xla.enabled(mirrored) and reason != SPARSE:
        _xla.turn_off(mirrored, reason)
    mirrored.__dict__["_one_trace_off"] = reason
    _log_once(mirrored, reason)


def _log_once(mirrored, reason):
    """Says once per wrapper and reason why the work is traced per replica.
    """
    said = mirrored.__dict__.setdefault("_one_trace_said", set())
    if reason in said:
        return
    said.add(reason)
    logging.getLogger("keras_mirror").info(
        "keras-mirror traces the replica step per replica, not once for "
        "all replicas, because %s.", reason)
