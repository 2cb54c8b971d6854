"""Gradient all-reduce through `tf.distribute.ReplicaContext.all_reduce`.

Buckets and overlap (as PyTorch DDP's gradient buckets): with
`bytes_per_pack`, gradients go in buckets filled from the *last* variable
backwards, and the buckets are issued in that order, one all-reduce each.
Backprop produces the last layers' gradients first, and a bucket's
all-reduce depends only on its own gradients, so TensorFlow's data-flow
executor starts it while earlier layers' gradients are still being
computed. The collective ops of one strategy are chained by an ordering
token in the order they are issued: issuing the first layer's bucket first
(variable order) would make every bucket wait for the whole backward pass.
`benchmarks/bench_network.py` measures both orders.

Sparse gradients (`tf.IndexedSlices`) of the replicas are joined exactly.

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

import math

import numpy as np
import tensorflow as tf

_DTYPES = {None: None, "float32": None, "bfloat16": tf.bfloat16,
           "float16": tf.float16}


def communication_options(implementation="auto", bytes_per_pack=0,
                          timeout_seconds=None):
    """Builds `tf.distribute.experimental.CommunicationOptions`.

    Args:
        implementation: str. `"auto"`, `"ring"` or `"nccl"`.
        bytes_per_pack: int. Packs gradients into buckets of about this many
            bytes before all-reducing (0 lets TensorFlow decide).
        timeout_seconds: float or None. A collective that does not finish in
            this time fails instead of waiting forever for a dead peer.
    """
    impls = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }
    if implementation not in impls:
        raise ValueError(
            "`implementation` must be one of "
            f"{sorted(impls)}. Received: implementation={implementation!r}"
        )
    if isinstance(bytes_per_pack, bool) or not isinstance(
            bytes_per_pack, (int, np.integer)) or bytes_per_pack < 0:
        raise ValueError(
            "`bytes_per_pack` must be a non-negative integer. "
            f"Received: bytes_per_pack={bytes_per_pack!r}"
        )
    if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, (int, float, np.integer,
                                                np.floating))
            or not timeout_seconds > 0 or not math.isfinite(timeout_seconds)):
        raise ValueError(
            "`timeout_seconds` must be positive (seconds) or None. "
            f"Received: timeout_seconds={timeout_seconds!r}"
        )
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=int(bytes_per_pack),
        timeout_seconds=(None if timeout_seconds is None
                         else float(timeout_seconds)),
        implementation=impls[implementation],
    )


def check_gradient_dtype(gradient_dtype):
    """Validates the `gradient_dtype` argument of `MirroredModel`."""
    if gradient_dtype not in _DTYPES:
        raise ValueError(
            "`gradient_dtype` must be one of None, 'float32', 'bfloat16' or "
            f"'float16'. Received: gradient_dtype={gradient_dtype!r}"
        )
    return gradient_dtype


def _cut(value):
    """`value` cut from the graph behind it, for a sum no gradient goes
    through: TF's `ReplicaContext.all_reduce` wraps its collective in a
    `tf.custom_gradient`, whose graph-mode bookkeeping walks back from the
    sum through every replica's graph behind it (the whole step's, for a
    gradient), at each call."""
    return tf.stop_gradient(value) if isinstance(value, tf.Tensor) else value


def all_reduce_sum(grads, options=None, gradient_dtype=None):
    """Sums `grads` (a list, entries may be None) over all replicas.

    Must run in a replica context. With `gradient_dtype`, floating gradients
    travel in that dtype and are cast back after the sum. With
    `options.bytes_per_pack`, one all-reduce per bucket of
    `reverse_buckets`, last layers first, each depending only on its own
    gradients so that it overlaps with the rest of backprop.
    """
    ctx = tf.distribute.get_replica_context()
    wire = _DTYPES[gradient_dtype]
    out = list(grads)
    present = []
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            # Sparse gradients (Embedding) are gathered, not summed: the
            # optimizer then sees every row's values, duplicates included,
            # as on one device (Adam squares the values before summing
            # duplicate rows, so a dense sum would update differently).
            out[i] = _all_gather_slices(ctx, g, wire, options)
        elif g is not None:
            present.append(i)
    values = []
    for i in present:
        g = grads[i]
        if wire is not None and g.dtype.is_floating:
            g = tf.cast(g, wire)
        values.append(g)
    if not values:
        return out
    reduced = [None] * len(values)
    pack_bytes = options.bytes_per_pack if options is not None else 0
    sizes = [(v.shape.num_elements() or 0) * v.dtype.size for v in values]
    # Each bucket is one collective: TensorFlow must not re-pack it.
    one_pack = _one_pack(options) if pack_bytes else options
    barrier = [] if _OVERLAP else values
    for bucket in reverse_buckets(sizes, pack_bytes):
        with tf.control_dependencies(barrier):
            # Gradients are not differentiated again: the collective's
            # input is cut (`_cut`), so that TF's gradient bookkeeping
            # around `all_reduce` walks no graph behind it.
            sums = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                  [_cut(values[i]) for i in bucket],
                                  options=one_pack)
        for i, r in zip(bucket, sums):
            reduced[i] = r
    for i, r in zip(present, reduced):
        out[i] = tf.cast(r, grads[i].dtype) if r.dtype != grads[i].dtype else r
    return out


# False makes every bucket wait for all gradients (no overlap with
# backprop): only for benchmarks/bench_network.py's comparison.
_OVERLAP = True


def _one_pack(options):
    """`options` with `bytes_per_pack=0`: one bucket is one collective."""
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=0, timeout_seconds=options.timeout_seconds,
        implementation=options.implementation)


def _all_gather_slices(ctx, slices, wire, options):
    """Every replica's rows of a sparse gradient, in replica order."""
    dtype = slices.values.dtype
    values = slices.values
    if wire is not None and dtype.is_floating:
        values = tf.cast(values, wire)
    values = ctx.all_gather(values, axis=0, options=options)
    indices = ctx.all_gather(slices.indices, axis=0, options=options)
    lengths = ctx.all_gather(tf.shape(slices.indices)[:1], axis=0,
                             options=options)
    values, indices = _join_sparse(
        values, indices, lengths, _static_rows(slices),
        unique=_from_unique(slices.indices))
    if values.dtype != dtype:
        values = tf.cast(values, dtype)
    return tf.IndexedSlices(values, indices, slices.dense_shape)


def buckets(sizes, bytes_per_pack):
    """Groups consecutive gradients into all-reduce buckets.

    Args:
        sizes: list of int. Each gradient's size in bytes, in variable
            order.
        bytes_per_pack: int. 0 puts everything in one bucket (TensorFlow
            packs as it likes); otherwise a bucket closes once it holds at
            least this many bytes, so every bucket but the last reaches the
            target and a gradient larger than it travels alone.

    Returns:
        A list of lists of indices into `sizes`, in order.
    """
    if not sizes:
        return []
    if not bytes_per_pack:
        return [list(range(len(sizes)))]
    out, current, filled = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        filled += size
        if filled >= bytes_per_pack:
            out.append(current)
            current, filled = [], 0
    if current:
        out.append(current)
    return out


def reverse_buckets(sizes, bytes_per_pack):
    """The all-reduce buckets in launch order: last gradients first.

    `buckets` applied to the gradients from the last variable backwards:
    the first bucket holds the last layers' gradients (the first that
    backprop produces), each bucket lists its indices in descending order,
    and a model's first layers fill the last, possibly smaller, bucket.
    With `bytes_per_pack` 0, one bucket of every index in variable order.

    Example: `reverse_buckets([384, 64, 192, 12], 256)` is
    `[[3, 2, 1], [0]]`.
    """
    if not bytes_per_pack:
        return buckets(sizes, 0)
    last = len(sizes) - 1
    return [[last - i for i in bucket]
            for bucket in buckets(sizes[::-1], bytes_per_pack)]


def bytes_per_step(variables, gradient_dtype=None):
    """Bytes that one replica sends into the gradient all-reduce per step."""
    wire = _DTYPES[gradient_dtype]
    total = 0
    for v in variables:
        dtype = tf.as_dtype(v.dtype)
        if wire is not None and dtype.is_floating:
            dtype = wire
        total += int(tf.TensorShape(v.shape).num_elements()) * dtype.size
    return total


def _join_sparse(values, indices, lengths, static_length, unique=False):
    """The replicas' slices, concatenated in replica order, as one device's.

    Args:
        values: the replicas' values, concatenated (rows first).
        indices: the replicas' indices, concatenated.
        lengths: int32 vector, each replica's number of rows.
        static_length: int or None, the rows of one replica's slices when
            known statically (batch-independent indices), else None.
        unique: bool, whether each replica's indices come from `tf.unique`
            (`_from_unique`): the rows are then summed by index.

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


def _static_rows(slices):
    """The static row count of one replica's `IndexedSlices`, or None."""
    return tf.TensorShape(slices.indices.shape).as_list()[0]


_PASS_THROUGH = ("Reshape", "Identity", "Cast")


def _from_unique(indices):
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
