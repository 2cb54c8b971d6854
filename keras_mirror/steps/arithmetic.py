"""The shard arithmetic every execution path shares.

Semantics (see README, "Exactness"): replica `r` receives `b_r` of the `B`
rows of the global batch. It computes the loss of its shard exactly as one
device would on those rows, `S_r` (compiled loss plus `model.losses`), and
contributes `(S_r - W) * b_r / B + W * [r == 0]`, where `W` is the weight
regularisation, which depends on no data and so counts once. For Keras's
default `sum_over_batch_size` reduction the contributions sum to the loss
one device computes on the whole global batch, so the all-reduced gradient
sum is the single-device gradient.

This module holds that arithmetic (a shard's rows, its contribution, zero
gradients for an empty shard, masks, the per-replica statistics); the
paths (`strategy`, `in_graph`, `own_step`) import it, it imports none.
"""


import warnings

import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.steps import _replica_stats

REPLICA_KEYS = _replica_stats.STAT_KEYS


def _first_leaf(structure):
    return next(t for t in tf.nest.flatten(structure) if t is not None)


def batch_rows(x):
    return tf.shape(_first_leaf(x))[0]


def loss_dtype(loss):
    """The dtype the step weighs `loss` in: its own (float64 for a float64
    model), float32 for a half-precision one (as Keras's losses are)."""
    dtype = tf.as_dtype(loss.dtype)
    return dtype if dtype in (tf.float32, tf.float64) else tf.float32


def ratio(numerator, denominator, dtype):
    """`numerator / denominator` (0 where the denominator is 0) in `dtype`.

    Computed in float64 and rounded once: a share `b_r / B` is then the
    correctly rounded value in float32 and exact to float64 precision in a
    float64 model (no float32 step on the way).
    """
    return tf.cast(tf.math.divide_no_nan(
        tf.cast(numerator, tf.float64), tf.cast(denominator, tf.float64)),
        dtype)


def weight_regularization(model, dtype=tf.float32):
    """Sum of the variables' regularisers, as Keras adds them to `losses`."""
    terms = [
        v.regularizer(v)
        for v in model.trainable_weights
        if v.regularizer is not None
    ]
    if not terms:
        return tf.zeros((), dtype)
    return tf.add_n([tf.cast(t, dtype) for t in terms])


def _count_nonfinite(tensors):
    """The number of NaN and Inf values in `tensors`.

    One count per dtype, over the tensors flattened and joined: this runs
    only in the rare branch of `norm_and_nonfinite`'s `cond`, but a
    lowered `cond` still dispatches every op of the branch not taken, so
    the branch is kept to a few ops per replica (not four per tensor).
    """
    groups = {}
    for t in tensors:
        if t is not None and tf.as_dtype(t.dtype).is_floating:
            t = tf.convert_to_tensor(t)
            groups.setdefault(t.dtype, []).append(tf.reshape(t, [-1]))
    counts = [
        tf.reduce_sum(tf.cast(~tf.math.is_finite(
            flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)),
            tf.int32))
        for flat in groups.values()
    ]
    return tf.add_n(counts) if counts else tf.zeros((), tf.int32)


def zero_if_empty(grads, rows):
    """`grads`, or exact zeros when the shard holds no rows.

    An empty shard's share of the global batch is 0, so its gradients are
    0 in exact arithmetic; in floating point a layer can still produce
    `0 * NaN` (BatchNormalization's mean of no rows is NaN), which would
    poison the all-reduced gradient. One `cond` per replica replaces them.
    Sparse gradients (`tf.IndexedSlices`, from `Embedding`) stay sparse:
    their values are replaced.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return grads
    dense = [grads[i].values if isinstance(grads[i], tf.IndexedSlices)
             else tf.convert_to_tensor(grads[i]) for i in present]
    kept = tf.cond(rows > 0, lambda: dense,
                   lambda: [tf.zeros_like(g) for g in dense])
    out = list(grads)
    for i, g in zip(present, kept):
        if isinstance(grads[i], tf.IndexedSlices):
            g = tf.IndexedSlices(g, grads[i].indices, grads[i].dense_shape)
        out[i] = g
    return out


def step_start(data, keys):
    """Reads the clock once, before any replica's work in the step.

    Returns `(start, data)`; `(None, data)` untouched when `keys` (the
    model's `_stat_keys()`) have no `replica_step_time`.

    `replica_step_time` is the time from this reading until a replica's
    gradients are ready. One reading per replica would
    serialise the replicas: inside a `tf.function`, TensorFlow runs stateful
    ops without resource inputs (`tf.timestamp`) in program order, so a
    replica's start would wait for the previous replica's end. The end
    readings are still ordered by replica, so a replica's reading is never
    earlier than the one before it; the slowest replica's time, the one the
    all-reduce waits for, is exact.
    """
    if "replica_step_time" not in keys:
        return None, data
    start = tf.timestamp()
    with tf.control_dependencies([start]):
        # The step's input is sliced after the clock is read.
        return start, tf.nest.map_structure(
            lambda t: None if t is None else tf.identity(t), data)


def norm_and_nonfinite(grads, shard_loss):
    """The global norm of `grads` and the count of non-finite values.

    A finite sum of squares plus loss proves every value finite (a NaN or
    Inf makes it non-finite), so the exact count, which reads every gradient
    once more, runs only when it can be nonzero (or when the sum overflows,
    where the count comes out 0). The check reads the sum of squares, not
    the norm, so that it does not wait for the square root: both statistics
    end the step, and every level of ops between the gradients and the
    step's outputs lengthens it.
    """
    dense = [tf.convert_to_tensor(g) for g in grads if g is not None]
    shard_loss = tf.convert_to_tensor(shard_loss)
    if dense:
        # `tf.linalg.global_norm`'s own formula, with the sum kept.
        half_squares = tf.add_n([tf.cast(tf.nn.l2_loss(g), tf.float32)
                                 for g in dense])
        norm = tf.sqrt(2.0 * half_squares)
    else:
        half_squares = norm = tf.zeros((), tf.float32)
    finite = tf.math.is_finite(
        half_squares + tf.reduce_sum(tf.cast(shard_loss, tf.float32)))
    nonfinite = tf.cond(finite, lambda: tf.zeros((), tf.int32),
                        lambda: _count_nonfinite(dense + [shard_loss]))
    return norm, nonfinite


def replica_clock(start, grads):
    """Seconds from `start` until `grads` are ready (`replica_step_time`).

    The reading waits for the gradients only, not for their statistics, so
    that it does not add a level of ops to the end of the step.
    """
    ready = [g for g in tf.nest.flatten(grads, expand_composites=True)
             if g is not None]
    with tf.control_dependencies(ready):
        return tf.timestamp() - start


def contribution(shard_loss, reg, rows, global_rows, is_first):
    """Replica `r`'s term of the global loss: `(S_r - W) b_r / B + W [r=0]`.

    `is_first` is a Python bool or a boolean tensor.
    """
    dtype = loss_dtype(shard_loss)
    shard_loss, reg = tf.cast(shard_loss, dtype), tf.cast(reg, dtype)
    share = ratio(rows, global_rows, dtype)
    first = tf.cast(is_first, dtype)
    # An empty shard's own loss may be NaN (a mean over no rows in a
    # `compute_loss` override); its share is 0 either way.
    weighted = tf.where(share > 0, (shard_loss - reg) * share,
                        tf.zeros_like(share))
    return weighted + reg * first


def weight_sum(sample_weight, mask=None, dtype=tf.float32):
    """The divisor of a `"mean_with_sample_weight"` loss on a shard.

    Keras divides that loss's weighted sum by the sum of its sample
    weights, merged with the output's Keras mask (`sample_weight * mask`,
    a trailing dimension of 1 squeezed where the ranks differ by one; a
    squeeze does not change the sum). The shards' divisors add up to the
    global batch's.
    """
    w = tf.cast(sample_weight, dtype)
    if mask is not None:
        m = tf.cast(mask, dtype)
        if m.shape.rank == w.shape.rank + 1 and m.shape[-1] == 1:
            m = tf.squeeze(m, -1)
        elif w.shape.rank == m.shape.rank + 1 and w.shape[-1] == 1:
            w = tf.squeeze(w, -1)
        w = w * m
    return tf.reduce_sum(w)


def valued_as_mean(total, elements):
    """`total / elements` in value, `total`'s own gradient.

    A loss with `reduction="none"` gives Keras's step a vector: the tape
    differentiates its sum, the loss tracker logs its mean. The replicas'
    contributions are terms of that sum (so that their gradients add up to
    one device's); their values, all-reduced, are logged, and are divided
    by the global batch's element count here, without changing a gradient.
    """
    elements = tf.cast(elements, total.dtype)

    @tf.custom_gradient
    def mean_valued(t):
        return tf.math.divide_no_nan(t, elements), lambda upstream: upstream

    return mean_valued(total)


def output_mask(y_pred):
    """The Keras mask of a single masked output, else None.

    Keras divides a masked output's loss by its unmasked entries, not by
    its rows, so a shard's share of the global loss is its share of the
    unmasked entries. That holds for one output; a model with several
    outputs and a mask on any of them is weighted by rows (not exact),
    with a warning.
    """
    leaves = tf.nest.flatten(y_pred)
    masks = [_compat.get_mask(t) for t in leaves]
    if all(m is None for m in masks):
        return None
    if len(leaves) > 1:
        warnings.warn(
            "keras-mirror weights each replica's loss by its rows; a model "
            "with several outputs and a mask on one of them divides that "
            "output's loss by its unmasked entries, so its replicated loss "
            "and gradients are not exactly one device's. Single-output "
            "masked models are exact.", UserWarning, stacklevel=2)
        return None
    return masks[0]


def unmasked_entries(mask):
    """A shard's count to weight a masked output's loss by (see above)."""
    return tf.reduce_sum(tf.cast(mask, tf.float32))


def with_mask(y_pred, mask):
    """`y_pred` (concatenated over shards) carrying the concatenated mask."""
    if mask is not None:
        _compat.set_mask(y_pred, mask)
    return y_pred


def _sample_weight_sum(sw, rows):
    """The shard's sum of sample weights (0 for a stand-in row's)."""
    if sw is None:
        return tf.cast(rows, tf.float32)
    total = tf.add_n([tf.reduce_sum(tf.cast(w, tf.float32))
                      for w in tf.nest.flatten(sw)])
    return tf.where(rows > 0, total, 0.0)


def pack_stats(per_replica, keys=REPLICA_KEYS):
    """The replicas' statistics as one float32 `[replicas, keys]` matrix.

    `per_replica` holds one dict of scalars per replica, with at least
    `keys` (the model's `_stat_keys()`); the matrix goes into the logs
    under `_replica_stats.PACKED` (see there for why one tensor).
    """
    scalars = [tf.cast(stats[k], tf.float32)
               for stats in per_replica for k in keys]
    return tf.reshape(tf.stack(scalars), [len(per_replica), len(keys)])


def compute_stats(keys, start, grads, shard_loss, rows, sw):
    """One replica's statistics named in `keys` (see `pack_stats`).

    Only what `keys` name is computed: with `replica_stats=False` the step
    reads no gradient a second time, unless `on_nonfinite` needs the count.
    """
    stats = {}
    # An empty shard has no loss (a mean over no rows can be NaN).
    shard_loss = tf.where(rows > 0, tf.cast(shard_loss, tf.float32), 0.0)
    if "replica_step_time" in keys:
        stats["replica_step_time"] = replica_clock(start, grads)
    if "replica_grad_norm" in keys:
        stats["replica_grad_norm"], stats["replica_nonfinite"] = (
            norm_and_nonfinite(grads, shard_loss))
    elif "replica_nonfinite" in keys:
        stats["replica_nonfinite"] = norm_and_nonfinite(grads, shard_loss)[1]
    if "replica_loss" in keys:
        stats["replica_loss"] = shard_loss
        stats["replica_samples"] = rows
        stats["replica_sample_weight"] = _sample_weight_sum(sw, rows)
    return stats
