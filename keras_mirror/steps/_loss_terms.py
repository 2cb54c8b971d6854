"""A batch's loss terms and their gradients, with no side effects.

`_loss_kinds.probe` tells a batch mean from a batch sum by each term's
value and gradient on a batch and on that batch repeated twice. Both are
computed as Keras's `fit` computes them (`model(x, training=True)`, the
model's own `compute_loss(..., training=True)`; `evaluate`'s with
`training=False` when it is the first call), in a graph pruned to the
ops the terms and their gradients need (`tf.compat.v1.wrap_function`, which
adds no automatic control dependencies, then `prune`): a metric updated in
`compute_loss`, the per-output loss trackers, BatchNormalization's moving
statistics and the seed generators' states are read, never written. The
user's Python code runs once per trace, as any tracing of a Keras step
runs it.

Random draws on the doubled batch repeat the batch's own (`_tiled_draws`):
a Dropout mask of the doubled batch is the batch's mask twice, so that a
sum exactly doubles and a mean keeps its value. A draw of `2 * rows * k`
rows repeats the batch's draw of `rows * k` rows in the doubled batch's
order (`_row_order`): its halves where the rows are example-major (a
Reshape of the batch) or cannot be read (a constant shape, as the probe's
static shapes make: in a model's forward pass, stacked blocks of the
batch are rare), each block of `rows` rows twice where they are stacked.
"""

import contextlib

import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.distribute import _rows
from keras_mirror.steps import _row_order
from keras_mirror.steps._reductions import call_compute_loss


class Terms:
    """One batch's loss terms, each `(value, flat gradient)` in numpy.

    `compiled`: the compiled loss (or `compute_loss` override) without the
    `model.losses` terms; `extras`: each `model.losses` term; `outputs`:
    `{output index: its compiled term}` (Keras's own `CompileLoss`).
    """

    def __init__(self, compiled, extras, outputs):
        self.compiled = compiled
        self.extras = list(extras)
        self.outputs = dict(outputs)


def _scalar(t):
    return tf.reduce_sum(tf.cast(t, tf.float32))


def _flat_gradient(tape, term, variables):
    # A variable the term does not reach (None here) has gradient 0: zeros
    # on both batches, which decide nothing. Sparse gradients are densified.
    grads = tape.gradient(term, variables)
    flat = [tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float32), [-1])
            if g is not None else tf.zeros([tf.size(v.value)], tf.float32)
            for g, v in zip(grads, variables)]
    return tf.concat(flat, 0) if flat else tf.zeros([0], tf.float32)


def _graph_terms(model, training, x, y, sample_weight):
    """The terms, traced: [compiled, *extras], {output: term}, gradients."""
    variables = list(model.trainable_variables)
    with tf.GradientTape(persistent=True) as tape:
        y_pred = model(x, training=training)
        total, values = call_compute_loss(model, x, y, y_pred,
                                          sample_weight, training)
        extras = [_scalar(e) for e in model.losses]
        compiled = _scalar(total) - tf.add_n([tf.zeros(())] + extras)
        outputs = {i: _scalar(v) for i, v in values}
    scalars = [compiled] + extras
    return ([(v, _flat_gradient(tape, v, variables)) for v in scalars],
            {i: (v, _flat_gradient(tape, v, variables))
             for i, v in outputs.items()})


def _pruned(model, batch, repeat, training):
    """`batch`'s terms as a function of its leaves, pruned to their ops."""
    leaves = tf.nest.flatten(batch, expand_composites=True)
    present = [i for i, t in enumerate(leaves) if t is not None]
    specs = [tf.TensorSpec(leaves[i].shape, leaves[i].dtype)
             for i in present]
    rows = int(_batch_rows(batch))

    def terms(*flat):
        full = [None] * len(leaves)
        for i, t in zip(present, flat):
            full[i] = t
        packed = tf.nest.pack_sequence_as(batch, full,
                                          expand_composites=True)
        with _tiled_draws(rows // 2 if repeat else None):
            return _graph_terms(model, training, *packed)

    wrapped = tf.compat.v1.wrap_function(terms, specs)
    fetches = tf.nest.pack_sequence_as(
        wrapped.structured_outputs, wrapped.outputs)
    return wrapped.prune(wrapped.inputs, fetches), [
        leaves[i] for i in present]


def _batch_rows(batch):
    leaf = next(t for t in tf.nest.flatten(batch) if t is not None)
    if isinstance(leaf, tf.SparseTensor):
        return leaf.dense_shape[0]
    return leaf.shape[0] if leaf.shape[0] is not None else tf.shape(leaf)[0]


def _numpy(scalars, outputs):
    pairs = [(float(v), np.asarray(g)) for v, g in scalars]
    return Terms(pairs[0], pairs[1:], {
        i: (float(v), np.asarray(g)) for i, (v, g) in outputs.items()})


def evaluate(model, batch, training=True):
    """`Terms` of `batch` (`(x, y, sample_weight)`) and of it twice.

    `training`: as `fit` (True) or `evaluate` (False) runs the model.
    """
    batch = tf.nest.map_structure(
        lambda t: t if t is None or isinstance(
            t, (tf.SparseTensor, tf.RaggedTensor)) else tf.convert_to_tensor(t),
        batch)
    doubled = tf.nest.map_structure(
        lambda t: None if t is None else _rows.twice(t), batch)
    out = []
    for data, repeat in ((batch, False), (doubled, True)):
        call, leaves = _pruned(model, data, repeat, training)
        out.append(_numpy(*call(*leaves)))
    return tuple(out)


# -- random draws on the doubled batch ----------------------------------------


def _lead(shape):
    if isinstance(shape, tf.TensorShape):
        shape = shape.as_list()
    if tf.is_tensor(shape):
        value = tf.get_static_value(shape)
        return None if value is None or len(value) == 0 else int(value[0])
    if not isinstance(shape, (list, tuple)) or not shape:
        return None
    lead = tf.get_static_value(shape[0]) if tf.is_tensor(shape[0]) \
        else shape[0]
    return None if lead is None else int(lead)


def _halved(shape):
    if tf.is_tensor(shape):
        value = tf.get_static_value(shape)
        return [int(value[0]) // 2] + [int(d) for d in value[1:]]
    shape = shape.as_list() if isinstance(shape, tf.TensorShape) else shape
    return [_lead(shape) // 2] + list(shape[1:])


def _doubled(lead, rows, order):
    """Whether a draw of `lead` rows is the doubled batch's (`2 * rows * k`
    rows): None if not, else whether its rows are stacked (`order()`)."""
    if lead is None or lead == 0 or lead % (2 * rows):
        return None
    return lead > 2 * rows and order()[0] == _row_order.STACKED


def _repeated(half, stacked, rows):
    """The doubled batch's draw from the batch's `half`: twice over, or
    each stacked block of `rows` rows twice."""
    if not stacked:
        return tf.concat([half, half], 0)
    rest = tf.shape(half)[1:]
    blocks = tf.reshape(half, tf.concat([[-1, rows], rest], 0))
    out = tf.reshape(tf.concat([blocks, blocks], 1),
                     tf.concat([[-1], rest], 0))
    out.set_shape([2 * half.shape[0]] + half.shape[1:])
    return out


def _firsts(value, rows):
    """The batch's own rows of a doubled batch's stacked blocks: the first
    block of each pair."""
    rest = tf.shape(value)[1:]
    pairs = tf.reshape(value, tf.concat([[-1, 2, rows], rest], 0))
    out = tf.reshape(pairs[:, 0], tf.concat([[-1], rest], 0))
    out.set_shape([value.shape[0] // 2] + value.shape[1:])
    return out


def _tiling(original, rows):
    def shaped(shape, *args, **kwargs):
        stacked = _doubled(_lead(shape), rows,
                           lambda: _row_order.of_shape(shape))
        if stacked is None:
            return original(shape, *args, **kwargs)
        half = original(_halved(shape), *args, **kwargs)
        return _repeated(half, stacked, rows)

    return shaped


def _tiling_first_argument(original, rows):
    """`dropout(inputs, ...)`, `categorical(logits, ...)`: by their rows."""
    def by_rows(value, *args, **kwargs):
        value = tf.convert_to_tensor(value)
        stacked = None if value.shape.rank in (None, 0) else _doubled(
            value.shape[0], rows, lambda: _row_order.of_rows(value))
        if stacked is None:
            return original(value, *args, **kwargs)
        half_rows = value.shape[0] // 2
        half = original(_firsts(value, rows) if stacked else value[:half_rows],
                        *_halved_noise(args, kwargs, half_rows), **kwargs)
        return _repeated(half, stacked, rows)

    return by_rows


def _halved_noise(args, kwargs, rows):
    """`dropout`'s positional arguments, and `kwargs` in place, with a
    `noise_shape` of the doubled batch's rows (`SpatialDropout`'s) halved.
    """
    args = list(args)
    if len(args) > 1:  # dropout(inputs, rate, noise_shape, ...)
        if args[1] is not None and _lead(args[1]) == 2 * rows:
            args[1] = _halved(args[1])
    elif kwargs.get("noise_shape") is not None and \
            _lead(kwargs["noise_shape"]) == 2 * rows:
        kwargs["noise_shape"] = _halved(kwargs["noise_shape"])
    return args


@contextlib.contextmanager
def _tiled_draws(rows):
    """Within the block, a draw for `2 * rows` rows repeats one for `rows`.

    The doubled batch's rows `i` and `rows + i` are equal, so they draw
    equal numbers; the seed generators advance once per draw, as before.
    `rows` None: draws are left as they are.
    """
    if rows is None:
        yield
        return
    module = _compat.random_module()
    by_rows = ("dropout", "categorical")
    replacements = {
        name: (_tiling_first_argument if name in by_rows else _tiling)(
            getattr(module, name), rows)
        for name in _compat.RANDOM_FUNCTIONS if name != "shuffle"}
    with _compat.replaced(
            module, replacements,
            reason="the loss-kind probe repeats a batch's draws for the "
            "batch doubled"):
        yield
