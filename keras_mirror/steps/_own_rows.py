"""Replicas that hold their own rows: the step's input, not gathered.

With `worker_input="shard"` and a `tf.data` input, Keras reads
`tf.distribute`'s distributed dataset of this worker's virtual shards
(`distribute/_worker_input.distributed`): each replica receives its own
part of the worker's rows. The step then trains each replica on those rows
as they are. What crosses between the replicas (and the network) besides
the gradients and statistics: the `N` row counts (the plan), in a step that
leaves a replica empty each replica's first row (the stand-in) and, for the
compiled metrics, the targets and sample weights (`x` only for a model's
own `compute_metrics`). The replicas' order is the global batch's (workers
in order, each worker's parts in order), so random draws and every
weighting are those of the global batch.
"""

import keras
import tensorflow as tf


def shards_of(strategy, per_replica):
    """`(shards, sizes, rows)` of an input whose replicas hold their own
    rows already (`worker_input="shard"` virtual shards): the plan is the
    rows each replica received (gathered: `N` integers), in replica
    order, which is the global batch's order. A replica without rows
    runs a stand-in row, the first row of the first replica that has
    rows, as in `ReplicaSteps._distribute`: each replica's first row is
    gathered for it, `N` rows, only in a step that leaves a replica
    empty.
    """
    def counts(*parts):
        first = next(t for t in parts if t is not None)
        return tf.shape(first)[:1]

    def first_rows(*parts):
        def one(t):
            if t is None:
                return None
            return tf.cond(tf.shape(t)[0] > 0, lambda: t[:1],
                           lambda: tf.zeros(tf.concat(
                               [[1], tf.shape(t)[1:]], axis=0), t.dtype))
        return tuple(one(t) for t in parts)

    with strategy.scope():
        sizes = tf.cast(strategy.gather(
            strategy.run(counts, args=tuple(per_replica)), axis=0),
            tf.int32)
        firsts = strategy.run(first_rows, args=tuple(per_replica))
        donor = tf.argmax(tf.cast(sizes > 0, tf.int32),
                          output_type=tf.int32)

        def stand_in(first):
            if first is None:
                return None
            # Gathered only in a step that leaves a replica without rows
            # (every worker takes the same branch: `sizes` is global).
            def gathered():
                return strategy.gather(first, axis=0)[donor:donor + 1]

            local = strategy.experimental_local_results(first)[0]
            return tf.cond(tf.reduce_any(tf.equal(sizes, 0)), gathered,
                           lambda: tf.zeros_like(local))

        stand_ins = tf.nest.map_structure(stand_in, firsts)

    def shard(*parts):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        empty = tf.equal(tf.gather(sizes, r), 0)
        return tuple(
            None if t is None else tf.cond(
                empty, lambda s=s: s, lambda t=t: t)
            for t, s in zip(parts, stand_ins))

    with strategy.scope():
        shards = strategy.run(shard, args=tuple(per_replica))
    return shards, sizes, tf.reduce_sum(sizes)


def targets_of(mirrored, packed, present):
    """`(x, y, sample_weight)` for the global metrics: the targets and
    weights gathered, `x` only where the model's `compute_metrics` is its
    own (Keras's ignores it)."""
    x, y, sw = mirrored._unpack(packed, present)
    own_metrics = type(mirrored._inner).compute_metrics is not \
        keras.Model.compute_metrics

    def gather(v):
        return None if v is None else mirrored._gather(v)

    return (gather(x) if own_metrics else None), gather(y), gather(sw)
