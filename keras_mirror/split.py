"""Split plans: which rows of a global batch each replica receives.

Two rules, both contiguous and in replica order, so that concatenating the
replicas' shards gives back the global batch:

- `"global"` (balanced): a global batch of `B` rows over `N` replicas gives
  the first `B % N` replicas `B // N + 1` rows and the others `B // N`
  (as `numpy.array_split`). Shards differ by at most one row; when `B < N`
  the last `N - B` shards are empty.
- `"per_replica"` (fill): each replica holds one user batch of up to
  `capacity` rows; replica `r` gets rows `[r * capacity, (r + 1) * capacity)`
  of the concatenation, so a short final batch leaves the last replicas with
  fewer rows or none. A global batch of more than `N * capacity` rows (the
  replica batches grew) is split with capacity `ceil(B / N)`, never
  clipped: every row is trained on, as one device trains on the joined
  batch.
"""

import tensorflow as tf


def balanced_sizes(batch_size, num_replicas):
    """Row counts per replica for the balanced rule, as a tuple of ints."""
    q, r = divmod(batch_size, num_replicas)
    return tuple(q + 1 if i < r else q for i in range(num_replicas))


def fill_sizes(batch_size, num_replicas, capacity):
    """Row counts per replica for the fill rule, as a tuple of ints.

    A global batch larger than `num_replicas * capacity` (per-replica
    batches that grew after the first) raises the capacity to
    `ceil(batch_size / num_replicas)`: no row is ever dropped.
    """
    capacity = max(capacity, -(-batch_size // num_replicas))
    return tuple(
        max(0, min(capacity, batch_size - i * capacity))
        for i in range(num_replicas)
    )


def sizes_tensor(batch_size, num_replicas, capacity=None):
    """The same rules on a scalar int32 tensor; returns an int32 vector."""
    ids = tf.range(num_replicas, dtype=tf.int32)
    batch_size = tf.cast(batch_size, tf.int32)
    if capacity is None:
        q = batch_size // num_replicas
        r = batch_size % num_replicas
        return q + tf.cast(ids < r, tf.int32)
    capacity = tf.maximum(capacity, -(-batch_size // num_replicas))
    return tf.clip_by_value(batch_size - ids * capacity, 0, capacity)


def offsets_tensor(sizes):
    """Start row of each replica's shard, given the sizes vector."""
    return tf.cumsum(sizes, exclusive=True)
