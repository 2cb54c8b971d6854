"""An input by its rows: what kind it is, its rows, and a shard's rows.

Every layer above reads input through these: whether `x` is arrays, how
many rows it has, whether a dataset ends, and rows `[start, start + size)`
of one input leaf, dense, sparse or ragged. The steps cut each global
batch into the replicas' shards by rows. A dense tensor is sliced and its
row count hidden from static shape inference (a shard statically of 0 rows
would make Keras skip the loss reduction); a `tf.sparse.SparseTensor` goes
through `tf.sparse.slice`, keeping its static non-row dimensions; a
`tf.RaggedTensor` slices by rows natively.
"""

import numpy as np
import tensorflow as tf


def rows(t, start, size):
    """`t`'s rows `start ... start + size - 1` (tensors or ints)."""
    if isinstance(t, tf.SparseTensor):
        return _sparse_rows(t, start, size)
    if isinstance(t, tf.RaggedTensor):
        return t[start:start + size]
    shard = t[start:start + size]
    shape = [None] + shard.shape.as_list()[1:]
    return tf.compat.v1.placeholder_with_default(shard, shape=shape)


def cyclic_rows(t, start, size, total):
    """`t`'s rows `(start + i) % total` for `i < size`: a shard, then rows
    after it, wrapping to the global batch's first (stand-in rows). A
    sparse `t` allows `start + size <= 2 * total`."""
    start = tf.cast(start, tf.int32)
    size = tf.cast(size, tf.int32)
    total = tf.cast(total, tf.int32)
    if isinstance(t, tf.SparseTensor):
        return _sparse_rows(tf.sparse.concat(0, [t, t]), start, size)
    index = tf.math.floormod(start + tf.range(size), total)
    shard = tf.gather(t, index)
    if isinstance(t, tf.RaggedTensor):
        return shard
    shape = [None] + shard.shape.as_list()[1:]
    return tf.compat.v1.placeholder_with_default(shard, shape=shape)


def _sparse_rows(t, start, size):
    rank = tf.shape(t.dense_shape)[0]
    begin = tf.concat([tf.reshape(tf.cast(start, tf.int64), [1]),
                       tf.zeros([rank - 1], tf.int64)], axis=0)
    extent = tf.concat([tf.reshape(tf.cast(size, tf.int64), [1]),
                        t.dense_shape[1:]], axis=0)
    shard = tf.sparse.slice(t, begin, extent)
    if t.shape.rank is not None:
        shard.set_shape([None] + t.shape.as_list()[1:])
    return shard


def between(t, start, stop=None):
    """Rows `start ... stop - 1` of an eager leaf (NumPy arrays too)."""
    if isinstance(t, tf.SparseTensor):
        stop = int(t.dense_shape[0]) if stop is None else stop
        return _sparse_rows(t, start, stop - start)
    return t[start:stop]


def head(t, size):
    """The first `size` rows of an eager leaf (NumPy arrays too), as a
    batch to build a model from."""
    if isinstance(t, tf.SparseTensor):
        return _sparse_rows(t, 0, size)
    return t[:size]


def twice(t):
    """`t`'s rows, then the same rows again (dense, sparse or ragged)."""
    if isinstance(t, tf.SparseTensor):
        return tf.sparse.concat(0, [t, t])
    if isinstance(t, tf.RaggedTensor):
        return tf.concat([t, t], axis=0)
    return tf.concat([tf.convert_to_tensor(t)] * 2, axis=0)


def is_per_replica(data):
    """Whether `data` holds each replica's own rows (a distributed
    dataset's element, `distribute/_worker_input.distributed`)."""
    leaves = [t for t in tf.nest.flatten(data) if t is not None]
    return bool(leaves) and isinstance(leaves[0],
                                       tf.distribute.DistributedValues)


def is_array(x):
    return all(isinstance(t, (np.ndarray, tf.Tensor, tf.SparseTensor,
                              tf.RaggedTensor))
               for t in tf.nest.flatten(x) if t is not None) and x is not None


def first_leaf(x):
    """`x`'s first leaf that is not None (None: an optional input)."""
    return next(t for t in tf.nest.flatten(x) if t is not None)


def num_rows(x):
    return int(first_leaf(x).shape[0])


def refuse_endless(name, x, steps_name, steps):
    """Refuses an endless dataset (`repeat()`) without a step count: Keras
    would read it forever, the epoch never ending (TF 2's Keras refused it
    so). `x` may also be a list of the virtual shards of an `input_fn`."""
    shards = x if isinstance(x, list) else [x]
    if steps is None and any(
            isinstance(s, tf.data.Dataset) and
            int(s.cardinality()) == tf.data.INFINITE_CARDINALITY
            for s in shards):
        raise ValueError(
            f"`{steps_name}` must be given for an endless `{name}` (a "
            "dataset repeated forever, `.repeat()`): without it the epoch "
            f"never ends. Pass `{steps_name}=...`, or repeat the dataset a "
            f"finite number of times. Received: {steps_name}=None")
