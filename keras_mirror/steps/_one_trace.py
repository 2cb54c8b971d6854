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

Where the work cannot be traced once, the step traces it per replica as
before, without a word (the trace is only a start-up cost): a masked
output (its loss shares need every replica's count, an all-reduce), sparse
or ragged shards (`Traced`), and any
cross-replica reduction inside the forward pass (TensorFlow refuses
`merge_call` inside a nested function: "`merge_call` called while defining
a new graph or a tf.function").
"""

import tensorflow as tf

from keras_mirror.steps import _batchnorm
from keras_mirror.steps import _xla
from keras_mirror.steps import arithmetic

SPARSE = "a shard is sparse or ragged"
REDUCES = ("the forward pass all-reduces across replicas, which TensorFlow "
           "does not allow inside a function traced once for all replicas")


def enabled(mirrored):
    """Whether the built-in step's replica work is traced once.

    Not for a model's own `train_step` (its optimizer all-reduces inside
    the step), synchronized BatchNormalization on the `"strategy"` path (an
    all-reduce in the forward pass), `run_eagerly`, or once a trace failed;
    with one local replica (one device, or a multi-worker process) only
    for XLA, whose compiled function it is (one trace has nothing to share
    there).
    """
    if mirrored._custom_step or mirrored.__dict__.get("_one_trace_off"):
        return False
    if getattr(mirrored._inner, "run_eagerly", False):
        return False
    if mirrored._execution == "strategy" and \
            _batchnorm.needs_forward_collectives(
                mirrored._inner, getattr(mirrored, "_batchnorm", "global")):
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
    """Raised before tracing work that one trace cannot serve exactly."""


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


def run(mirrored, traced, plain):
    """`traced()` (the step with the work traced once), else `plain()`.

    A trace that cannot serve every replica turns the single trace off for
    this wrapper, and the step is built again by `plain()`.
    """
    if not enabled(mirrored):
        _xla.enabled(mirrored)  # warns once why XLA is off, if it was asked
    else:
        try:
            return traced()
        except _xla.Unsupported as e:
            turn_off(mirrored, str(e))
        except Unshared as e:
            mirrored.__dict__["_one_trace_off"] = str(e)
        except RuntimeError as e:
            if "merge_call" not in str(e) and REDUCES not in str(e):
                raise
            turn_off(mirrored, REDUCES)
    return plain()


def turn_off(mirrored, reason):
    """Traces per replica from now on (and without XLA, saying why)."""
    if _xla.enabled(mirrored):
        _xla.turn_off(mirrored, reason)
    mirrored.__dict__["_one_trace_off"] = reason
