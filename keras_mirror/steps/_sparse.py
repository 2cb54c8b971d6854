"""Sparse gradients (`tf.IndexedSlices`) of the replicas, joined exactly.

An `Embedding` looked up with the batch's tokens has, on one device, one
gradient row per token occurrence (duplicates included); Keras's Adam and
RMSprop square each row's values before duplicates add up. The replicas'
rows, joined in replica order, are exactly those rows: they are gathered,
not summed.

An embedding looked up with indices that do not come from the batch (a
position embedding, `pos_emb(ops.arange(maxlen))`) has, on one device, one
row per index whose values are summed over the whole batch. Every replica
then holds the same indices, each row summed over its shard; one device's
gradient is the sum of the replicas' values on those indices, not their
rows side by side (Adam would square `N` partial sums instead of their
total). Such a gradient is recognised by indices of a static length (no
batch dimension in them) that are identical on every replica at run time;
its values are summed.

A `Dense` layer fed a `tf.sparse.SparseTensor` has a kernel gradient of
one row per feature index present in the batch, each summed over the
batch's rows (`embedding_lookup_sparse` takes `tf.unique` of the ids). One
device's rows are then the union of the replicas' indices, in order of
first appearance, each the sum of the replicas' rows: they are summed by
index. Such a gradient is recognised by indices that come from a `Unique`
op in the step's graph.
"""

import tensorflow as tf


def join(values, indices, lengths, static_length, unique=False):
    """The replicas' slices, concatenated in replica order, as one device's.

    Args:
        values: the replicas' values, concatenated (rows first).
        indices: the replicas' indices, concatenated.
        lengths: int32 vector, each replica's number of rows.
        static_length: int or None, the rows of one replica's slices when
            known statically (batch-independent indices), else None.
        unique: bool, whether each replica's indices come from `tf.unique`
            (`from_unique`): the rows are then summed by index.

    Returns:
        `(values, indices)`: summed over replicas when every replica holds
        the same indices of a static length, else as given.
    """
    if unique:
        ids, position = tf.unique(indices)
        return tf.math.unsorted_segment_sum(
            values, position, tf.shape(ids)[0]), ids
    if static_length is None or static_length == 0:
        return values, indices
    n = int(lengths.shape[0])
    if n == 1:
        return values, indices
    rows = static_length

    def same_indices():
        grid = tf.reshape(indices, [n, rows])
        return tf.reduce_all(tf.equal(grid, grid[:1]))

    same = tf.cond(tf.reduce_all(tf.equal(lengths, rows)), same_indices,
                   lambda: tf.constant(False))

    def summed():
        shape = tf.concat([[n, rows], tf.shape(values)[1:]], 0)
        return tf.reduce_sum(tf.reshape(values, shape), 0), indices[:rows]

    return tf.cond(same, summed, lambda: (values, indices))


def static_rows(slices):
    """The static row count of one replica's `IndexedSlices`, or None."""
    return tf.TensorShape(slices.indices.shape).as_list()[0]


_PASS_THROUGH = ("Reshape", "Identity", "Cast")


def from_unique(indices):
    """Whether a traced gradient's indices are the output of `tf.unique`
    (through reshapes), as for a `Dense` kernel fed a sparse input."""
    op = getattr(indices, "op", None)
    for _ in range(4):
        if op is None:
            return False
        if op.type == "Unique":
            return True
        if op.type not in _PASS_THROUGH or not op.inputs:
            return False
        op = op.inputs[0].op
    return False
