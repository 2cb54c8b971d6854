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
"""

import contextlib

import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active
from keras_mirror.steps import _slicing


def bounds(sizes):
    """`(starts, runs)`: where each replica's shard starts, and its rows.

    A replica with rows runs its rows of the plan; an empty one runs one
    stand-in row, the global batch's first.
    """
    sizes = tf.cast(sizes, tf.int32)
    offsets = tf.cumsum(sizes, exclusive=True)
    starts = tf.where(sizes > 0, offsets, tf.zeros_like(offsets))
    return starts, tf.maximum(sizes, 1)


def shard(t, start, run):
    """Rows `[start, start + run)` of `t` (dense, sparse or ragged).

    Its row count stays dynamic (`_slicing.rows`): a shard whose row count
    is static would let Keras skip a loss reduction on it.
    """
    if t is None:  # an optional input given None, as on one device
        return None
    return _slicing.rows(t, start, run)


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
    (global sums of the values, their squares and the counts), each local
    term multiplied by 0 on a stand-in replica and 1 elsewhere.
    """

    def moments(x, axes, keepdims):
        replica_ctx = tf.distribute.get_replica_context()
        stand_in = is_stand_in()
        if not replica_ctx or stand_in is None or \
                replica_ctx.num_replicas_in_sync == 1:
            return original(x, axes, keepdims)
        keep = tf.cast(tf.logical_not(stand_in), x.dtype)
        local_sum = tf.reduce_sum(x, axis=axes, keepdims=True) * keep
        local_squares = tf.reduce_sum(tf.square(x), axis=axes,
                                      keepdims=True) * keep
        local_count = tf.reduce_sum(tf.ones_like(x), axis=axes,
                                    keepdims=True) * keep
        total = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                       local_sum)
        squares = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                         local_squares)
        count = replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                       local_count)
        mean = tf.math.divide_no_nan(total, count)
        variance = tf.maximum(
            tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        if not keepdims:
            mean = tf.squeeze(mean, axes)
            variance = tf.squeeze(variance, axes)
        return mean, variance

    return moments


@contextlib.contextmanager
def exclude_from_moments():
    """Within the block, synchronized BatchNorm leaves stand-ins out."""
    module = _compat.moments_module()
    original = getattr(module, _compat.SYNC_MOMENTS)
    with _compat.replaced(module, {
            _compat.SYNC_MOMENTS: _moments_sync(original)}):
        yield
