"""Stand-in rows: no replica ever runs the user's model on 0 rows.

A global batch smaller than the replica count, or the last batch of most
epochs, leaves some replicas' shards empty. One device never sees an empty
batch, and TensorFlow's kernels are not all safe on one: TF 2.21's oneDNN
CPU convolution returns a tensor of the *input's* shape for 0 rows, so its
gradient, a `concatenate` or a cross-entropy after it fail; cuDNN and NCCL
have their own 0-row cases (tensorflow#61231). Skipping an empty replica is
not possible on the `"strategy"` path either: every replica must reach every
collective in the same order (the gradient all-reduce, synchronized
BatchNorm's statistics, a model's own step's optimizer hooks).

So an empty shard runs one *stand-in row*: the global batch's first row,
which is real data (zeros could make a masked model produce NaN). The
replica's share of the global batch stays 0 (`ReplicaContext.shard_size`
is 0, `share` 0), and the stand-in counts for nothing anywhere:

- its loss contribution, batch-sum terms included, is 0 and its gradients
  are exact zeros (`arithmetic.contribution`, `arithmetic.zero_if_empty`);
- its predictions are dropped before the global metrics (`real_rows`);
- no metric update a replica makes (Keras's compiled metrics, a user's own
  `metric.update_state` in their step) runs on a stand-in replica
  (`_metric_weights.replica_weights`);
- synchronized BatchNormalization's cross-replica sums and counts leave it
  out (`exclude_from_moments`); the moving statistics kept are replica 0's,
  which always holds real rows;
- its `keras.random` draws advance the seed generators exactly as every
  other replica's (the same code runs), so the generators' state after the
  step is one device's;
- `ReplicaContext.all_reduce_sum` adds 0 for it.

Where TensorFlow runs oneDNN's CPU kernels, a model with a convolution is
also kept off odd batches (`row_multiple`): TF 2.21's oneDNN convolution
backprop aborts the process or raises on some odd ones (`docs/onednn.md`).
In training, each replica then runs an even number of rows: its shard,
then *stand-in rows* (the rows after its shard in the global batch, cyclic,
so real data again), counting for nothing as above, row by row:

- the model's outputs, and `x`, `y` and the sample weights, are cut back
  to the shard's rows (at least one) before the loss (`unpadded`), so
  the loss, its weights and the metrics see only real rows;
- BatchNormalization's moments, synchronized and global, leave the
  stand-in rows out (`row_keep`);
- a `keras.random` draw shaped like the padded shard gives the shard's
  rows their one-device numbers (`steps/_random.py`), so padding shifts
  no real row's draw.
"""

import contextlib
import logging
import weakref

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active
from keras_mirror.replica_context import summed
from keras_mirror.steps import _slicing

# Each replica's rows in training, where oneDNN runs a model with a
# convolution, are a multiple of 2. Measured on TF 2.21, one CPU device,
# plain Keras (benchmarks/results/shard_shapes/conv_matrix.md): every
# failure (SIGABRT "corrupted size vs. prev_size", SIGSEGV, `AbortedError`
# in `Conv2DBackpropFilter`) was a 1x1 convolution of stride 2 on an odd
# batch, 1 to 59 rows; no even batch failed, and no minimum row count
# avoids them (7, 9, 31 and 59 rows failed too). Only Conv2D was measured,
# so any convolution counts; a padded row costs at most one row per replica.
ROW_MULTIPLE = 2
_CONVOLUTIONS = tuple(getattr(keras.layers, name) for name in (
    "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
    "Conv3DTranspose", "SeparableConv1D", "SeparableConv2D",
    "DepthwiseConv1D", "DepthwiseConv2D") if hasattr(keras.layers, name))
_SAID = weakref.WeakSet()  # the models `row_multiple` said it keeps at 1


def row_multiple(model, devices, reductions=None):
    """Each replica's rows in training are a multiple of this (1 or 2).

    `ROW_MULTIPLE` where TensorFlow runs oneDNN's CPU kernels
    (`_compat.onednn_enabled`), the replicas are CPUs and `model` has a
    convolution; else 1 (no stand-in rows beyond an empty shard's one).
    Not for a model whose forward pass adds loss terms (`add_loss`,
    activity regularisers: `reductions.extras`): they would see the
    stand-in rows, so it keeps 1, said once.
    """
    if not _onednn_convolutions(model, devices):
        return 1
    if reductions is not None and reductions.extras:
        if model not in _SAID:
            _SAID.add(model)
            logging.getLogger("keras_mirror").warning(
                "keras-mirror does not pad odd shards of %r to even ones on "
                "oneDNN's CPU kernels: its forward pass adds loss terms, "
                "which the stand-in rows would change. TF 2.21's oneDNN "
                "convolution backprop can abort on odd batches "
                "(docs/onednn.md); set TF_ENABLE_ONEDNN_OPTS=0 to avoid it.",
                model.name)
        return 1
    return ROW_MULTIPLE


def _onednn_convolutions(model, devices):
    """Whether `model`'s convolutions run oneDNN's CPU kernels here."""
    from keras_mirror.wrapper import _rebuild

    return all("CPU" in str(d).upper() for d in devices) and any(
        isinstance(layer, _CONVOLUTIONS)
        for layer in _rebuild.all_layers(model)) and _compat.onednn_enabled()


def warn_unpadded_own_step(model, devices):
    """Says once, when wrapping, that a model's own `train_step` runs its
    shards as they are where oneDNN's convolutions could abort on them."""
    if len(devices) < 2 or not _onednn_convolutions(model, devices):
        return
    logging.getLogger("keras_mirror").warning(
        "%r has its own `train_step`, which keras-mirror runs on each "
        "replica's shard as it is: odd shards are not padded to even ones "
        "on oneDNN's CPU kernels, and TF 2.21's oneDNN convolution "
        "backprop can abort on odd batches (docs/onednn.md). Use global "
        "batches that give every replica an even number of rows, or set "
        "TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts.", model.name)


def bounds(sizes, multiple=1):
    """`(starts, runs)`: where each replica's shard starts, and its rows.

    A replica with rows runs its rows of the plan; an empty one runs one
    stand-in row, the global batch's first. With `multiple` > 1 each run
    is rounded up to a multiple of it: the shard, then stand-in rows.
    """
    sizes = tf.cast(sizes, tf.int32)
    offsets = tf.cumsum(sizes, exclusive=True)
    starts = tf.where(sizes > 0, offsets, tf.zeros_like(offsets))
    runs = tf.maximum(sizes, 1)
    if multiple > 1:
        runs = (runs + multiple - 1) // multiple * multiple
    return starts, runs


def shard(t, start, run, global_rows=None):
    """Rows `[start, start + run)` of `t` (dense, sparse or ragged).

    Its row count stays dynamic (`_slicing.rows`): a shard whose row count
    is static would let Keras skip a loss reduction on it. With
    `global_rows` (padded shards) the rows wrap around the global batch:
    row `(start + i) % global_rows` (`_slicing.cyclic_rows`).
    """
    if t is None:  # an optional input given None, as on one device
        return None
    if global_rows is not None:
        return _slicing.cyclic_rows(t, start, run, global_rows)
    return _slicing.rows(t, start, run)


def unpadded(structure, rows):
    """Each leaf's first `max(rows, 1)` rows, Keras masks kept: a padded
    shard cut back to the rows an unpadded one runs (`bounds`)."""
    keep = tf.maximum(tf.cast(rows, tf.int32), 1)

    def cut(t):
        if t is None:
            return None
        out = _slicing.rows(t, 0, keep)
        mask = _compat.get_mask(t) if isinstance(t, tf.Tensor) else None
        if mask is not None:
            _compat.set_mask(out, _slicing.rows(mask, 0, keep))
        return out

    return tf.nest.map_structure(cut, structure)


def row_keep(x):
    """`[n, 1, ...]` in `x.dtype`: 1 on this replica's shard rows, 0 on its
    stand-in rows (all of an empty shard's); None outside a replica step."""
    ctx = active()
    if ctx is None or not ctx.distributed or ctx.shard_size is None or \
            x.shape.rank is None:
        return None
    n = tf.shape(x)[0]
    keep = tf.range(n) < tf.cast(ctx.shard_size, tf.int32)
    return tf.reshape(tf.cast(keep, x.dtype), [-1] + [1] * (x.shape.rank - 1))


def real_rows(structure, rows):
    """Each leaf's first `rows` rows: a replica's predictions, no stand-in.
    """
    return tf.nest.map_structure(
        lambda t: None if t is None else t[:rows], structure)


def is_stand_in():
    """A boolean tensor: this replica runs a stand-in row (or None)."""
    ctx = active()
    if ctx is None or not ctx.distributed or ctx.shard_size is None:
        return None
    return tf.equal(tf.cast(ctx.shard_size, tf.int32), 0)


def unless_stand_in(fn):
    """`fn` made a no-op on a stand-in replica (a metric's `update_state`).
    """

    def guarded(*args, **kwargs):
        stand_in = is_stand_in()
        if stand_in is None or tf.executing_eagerly():
            return fn(*args, **kwargs)

        def update():
            fn(*args, **kwargs)
            return tf.constant(True)

        return tf.cond(stand_in, lambda: tf.constant(False), update)

    return guarded


def _moments_sync(original):
    """Keras's synchronized moments, a stand-in replica's rows left out.

    The arithmetic of `keras.src.backend.tensorflow.nn._compute_moments_sync`
    (global sums of the values, their squares and the counts), each stand-in
    row's terms multiplied by 0 and each shard row's by 1 (`row_keep`).
    """

    def moments(x, axes, keepdims):
        replica_ctx = tf.distribute.get_replica_context()
        stand_in = is_stand_in()
        if not replica_ctx or stand_in is None or \
                replica_ctx.num_replicas_in_sync == 1:
            return original(x, axes, keepdims)
        keep = row_keep(x) if _on_batch_axis(x, axes) else tf.cast(
            tf.logical_not(stand_in), x.dtype)
        local_sum = tf.reduce_sum(x * keep, axis=axes, keepdims=True)
        local_squares = tf.reduce_sum(tf.square(x) * keep, axis=axes,
                                      keepdims=True)
        local_count = tf.reduce_sum(tf.ones_like(x) * keep, axis=axes,
                                    keepdims=True)
        total, squares, count = (
            summed(t) for t in (local_sum, local_squares, local_count))
        mean = tf.math.divide_no_nan(total, count)
        variance = tf.maximum(
            tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        if not keepdims:
            mean = tf.squeeze(mean, axes)
            variance = tf.squeeze(variance, axes)
        return mean, variance

    return moments


def _on_batch_axis(x, axes):
    rank = x.shape.rank
    return rank is not None and 0 in [
        int(a) % rank for a in tf.nest.flatten(axes)]


@contextlib.contextmanager
def exclude_from_moments():
    """Within the block, synchronized BatchNorm leaves stand-ins out."""
    module = _compat.moments_module()
    original = getattr(module, _compat.SYNC_MOMENTS)
    with _compat.replaced(module, {
            _compat.SYNC_MOMENTS: _moments_sync(original)},
            reason="synchronized BatchNorm's sums and counts leave a "
            "stand-in row out"):
        yield
