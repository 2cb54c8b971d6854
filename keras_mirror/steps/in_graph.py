"""The in-graph execution path: one graph, one shard per device.

`MirroredModel(..., execution="in_graph")` (the `"auto"` choice for logical
CPUs on one host, and for a single device) keeps one copy of the variables,
on the first device, and builds each step as one TensorFlow graph in which
replica `r`'s forward and backward pass run under `tf.device(devices[r])` on
its shard. It shares every rule of the `tf.distribute` path (`arithmetic.py`):

- the same split plan (`split.sizes_tensor`), so `split_plan` holds;
- the same loss weighting, `(S_r - W) * b_r / B + W * [r == 0]`
  (`arithmetic.contribution`);
- the same sum of the replicas' gradients, here an in-graph `add_n` on the
  variables' device, in `gradient_dtype` when one is set;
- one optimizer update, skipped on all replicas for a non-finite step;
- the same per-replica statistics, in replica order.

Why a second path: on CPU devices of one host every replica shares the
same memory, so `tf.distribute`'s mirrored copies buy nothing and cost an
optimizer update per copy and per variable, which dominated the step time
of small models (see `benchmarks/README.md`). On GPUs the `tf.distribute`
path (NCCL all-reduce, local variable copies) is the right one and stays
the default there.

Non-trainable state written in training (BatchNormalization's moving
statistics, seed generators) follows the `tf.distribute` path's semantics:
every replica starts the step from the same state, and the state kept is
replica 0's (TensorFlow's mirrored variables with `aggregation="none"`
keep each replica's own write, and the first replica's copy is the one that
Keras reads, saves and checkpoints).
"""

import contextlib

import keras
import tensorflow as tf

from keras_mirror import allreduce
from keras_mirror import split
from keras_mirror.callbacks import _replica_logs
from keras_mirror.replica_context import ReplicaContext
from keras_mirror.replica_context import activate
from keras_mirror.steps import _one_trace
from keras_mirror.steps import _reductions
from keras_mirror.steps import _scope
from keras_mirror.steps import _sparse
from keras_mirror.steps import _stand_in
from keras_mirror.steps import _xla
from keras_mirror.steps import arithmetic

_NO_REDUCE = (
    "`replica_context().all_reduce_*` is not available on the 'in_graph' "
    "execution path, whose replicas are traced one after the other into "
    "one graph. Use `MirroredModel(..., execution='strategy')`.")


def _context(mirrored, r, shard_rows, rows, offset):
    return activate(ReplicaContext(
        r, len(mirrored.devices), shard_rows, rows, distributed=True,
        reduce_error=_NO_REDUCE, offset=offset))


def _shards(mirrored, data, rows):
    """`[(shard, offset, rows of the plan)]`, each sliced on its device.

    An empty shard holds one stand-in row (`_stand_in`): its rows of the
    plan are 0.
    """
    if len(mirrored.devices) == 1:
        return [(data, 0, rows)]
    sizes = mirrored._plan_sizes(rows)
    offsets = split.offsets_tensor(sizes)
    return [(shard, offsets[r], sizes[r]) for r, shard in enumerate(
        mirrored._in_graph_shards(data, rows))]


def _loss(mirrored, x, y, y_pred, sw, training):
    return tf.cast(_reductions.compute_loss(
        mirrored._inner, x, y, y_pred, sw, training), tf.float32)


def _contribution(mirrored, shard_loss, extras, count, total, first, rows):
    """`arithmetic.contribution`, each term by its kind (`_reductions`).

    A stand-in shard (`rows` 0) adds nothing but, on replica 0, the weight
    regularisation.
    """
    return _reductions.weighted(
        getattr(mirrored, "_reductions", None), mirrored._inner, shard_loss,
        extras, count, total, first, rows)


def _concat(parts, rows, masks=None):
    """The shards' predictions in replica order, with their mask if any.

    The parts hold the stand-in rows of empty shards (`_stand_in`), which
    the plan puts last (its sizes never increase with the replica id): the
    global batch's `rows` rows come first, and one slice of the joined
    tensor drops every stand-in, instead of one slice per replica.
    """
    if len(parts) == 1:
        return parts[0]
    joined = _stand_in.real_rows(tf.nest.map_structure(
        lambda *p: tf.concat(p, axis=0), *parts), rows)
    if masks and masks[0] is not None:
        arithmetic.with_mask(joined, _stand_in.real_rows(
            tf.concat(masks, axis=0), rows))
    return joined


def _shares(masks, shard_rows, rows):
    """Each shard's count to weight its loss by, and their total.

    Rows, or a masked output's unmasked entries (`arithmetic.output_mask`).
    """
    if masks[0] is None:
        return shard_rows, rows
    counts = [tf.where(r > 0, arithmetic.unmasked_entries(m), 0.0)
              for m, r in zip(masks, shard_rows)]
    return counts, tf.add_n(counts)


def _sum_gradients(per_replica, variables, gradient_dtype, device):
    """The in-graph all-reduce: per-variable sums over replicas."""
    wire = allreduce.wire_dtype(gradient_dtype)
    summed = []
    for i, v in enumerate(variables):
        parts = [g[i] for g in per_replica if g[i] is not None]
        if not parts:
            summed.append(None)
            continue
        if all(isinstance(p, tf.IndexedSlices) for p in parts):
            summed.append(_gather_slices(parts, wire, device))
            continue
        parts = [tf.convert_to_tensor(p) for p in parts]
        dtype = parts[0].dtype
        if wire is not None and dtype.is_floating:
            parts = [tf.cast(p, wire) for p in parts]
        with tf.device(device):
            total = parts[0] if len(parts) == 1 else tf.add_n(parts)
            summed.append(tf.cast(total, dtype) if total.dtype != dtype
                          else total)
    return summed


def _gather_slices(parts, wire, device):
    """Sparse gradients (Embedding) are joined, not summed.

    The optimizer then sees every row's values, duplicates included, as on
    one device (`allreduce._all_gather_slices` on the strategy path).
    """
    dtype = parts[0].values.dtype
    values = [p.values for p in parts]
    if wire is not None and dtype.is_floating:
        values = [tf.cast(v, wire) for v in values]
    with tf.device(device):
        joined = tf.concat(values, axis=0) if len(values) > 1 else values[0]
        indices = tf.concat([p.indices for p in parts], axis=0)
        statics = {_sparse.static_rows(p) for p in parts}
        if len(parts) > 1 and all(_sparse.from_unique(p.indices)
                                  for p in parts):
            joined, indices = _sparse.join(joined, indices, None, None, True)
        elif len(parts) > 1 and len(statics) == 1:
            lengths = tf.stack([tf.shape(p.indices)[0] for p in parts])
            joined, indices = _sparse.join(joined, indices, lengths,
                                           statics.pop())
        if joined.dtype != dtype:
            joined = tf.cast(joined, dtype)
    return tf.IndexedSlices(joined, indices, parts[0].dense_shape)


class _Shard:
    """One replica's forward pass: its rows, predictions, loss, tape.

    An empty shard's predictions, mask and sample weights are its stand-in
    row's (`_concat` and `arithmetic.compute_stats` leave them out).
    """

    def __init__(self, device, rows, sw, tape, y_pred, loss, extras, mask):
        self.device, self.rows, self.sw, self.tape = device, rows, sw, tape
        self.y_pred, self.loss, self.extras = y_pred, loss, extras
        self.mask = mask


def _forward(mirrored, packed, present, rows, training, guard=None):
    """Runs each replica's forward pass and loss on its device, in order.

    With `training`, each pass is recorded on its own tape; `guard` (a
    `arithmetic.StateGuard`) gives each replica the same starting state.
    """
    inner = mirrored._inner
    many = len(mirrored.devices) > 1
    shards = []
    with _scope.replica_scope(mirrored):
        for r, (device, (shard, offset, shard_rows)) in enumerate(
                zip(mirrored.devices, _shards(mirrored, packed, rows))):
            xr, yr, swr = mirrored._unpack(shard, present)
            with tf.device(device):
                tape = tf.GradientTape() if training else None
                with (tape or contextlib.nullcontext()), _context(
                        mirrored, r, shard_rows, rows, offset):
                    y_pred = inner(xr, training=training)
                    loss = _loss(mirrored, xr, yr, y_pred, swr, training)
                    extras = list(inner.losses)
                mask = arithmetic.output_mask(y_pred) if many else None
            if guard is not None:
                guard.after_replica(r)
            shards.append(_Shard(
                device, shard_rows, swr, tape, y_pred, loss, extras, mask))
    return shards


def _replicas_eager(mirrored, packed, present, rows, keys, start):
    """Each replica's (gradients, contribution, stats, predictions, mask).

    Forward passes first: a masked output's shares need every shard's
    count of unmasked entries. Each replica's tape is entered again to
    record its share of the loss.
    """
    optimizer = mirrored._inner.optimizer
    variables = mirrored._inner.trainable_weights
    n = len(mirrored.devices)
    guard = arithmetic.StateGuard(mirrored._inner, n)
    shards = _forward(mirrored, packed, present, rows, True, guard)
    counts, total = _shares([s.mask for s in shards],
                            [s.rows for s in shards], rows)
    out = []
    for r, shard in enumerate(shards):
        with tf.device(shard.device):
            with shard.tape:
                if n == 1:
                    contribution = shard.loss  # the whole batch: share 1
                else:
                    contribution = _contribution(
                        mirrored, shard.loss, shard.extras, counts[r], total,
                        r == 0, shard.rows)
                scaled = optimizer.scale_loss(contribution)
            g = shard.tape.gradient(scaled, variables)
            if r > 0:  # replica 0 holds a row of every non-empty batch
                g = arithmetic.zero_if_empty(g, shard.rows)
            stats = _stats(keys, start, g, shard.loss, shard.rows, shard.sw)
        out.append((g, contribution, stats, shard.y_pred, shard.mask))
    guard.finish()
    return out


def _traced_work(mirrored, rows):
    """Every replica's forward pass, loss and gradients: one function.

    Traced once (`_one_trace`; XLA-compiled with `jit_compile`) and called
    on each replica's device with its shard and its place in the batch
    (tensors: the replica id too). The shares are rows; a masked output,
    whose shares need every replica's count, raises `_xla.Unsupported`
    while tracing.
    """
    inner = mirrored._inner
    n = len(mirrored.devices)

    def body(xr, yr, swr, r, shard_rows, offset, scale):
        with activate(ReplicaContext(
                r, n, shard_rows, rows, distributed=True,
                reduce_error=_NO_REDUCE, offset=offset)):
            y_pred = inner(xr, training=True)
            # A mask would not survive the function's boundary, and its
            # shares need every replica's count.
            _xla.check_no_mask(arithmetic.output_mask(y_pred))
            loss = _loss(mirrored, xr, yr, y_pred, swr, True)
            contribution = loss if n == 1 else _contribution(
                mirrored, loss, list(inner.losses), shard_rows, rows,
                tf.equal(r, 0), shard_rows)
        return (y_pred, loss, contribution), contribution * scale

    return _one_trace.replica_work(mirrored, body, shards=(0, 1, 2))


def _replicas_traced(mirrored, packed, present, rows, keys, start):
    """`_replicas_eager`'s results, each replica's work one traced call.

    Every replica starts from the same non-trainable state and replica 0's
    writes are kept (the `StateGuard` semantics, without its copies).
    """
    inner = mirrored._inner
    trainable = _xla.values(inner.trainable_variables)
    non_trainable = _xla.values(inner.non_trainable_variables)
    scale = tf.cast(inner.optimizer.scale_loss(tf.ones((), tf.float32)),
                    tf.float32)
    work = _traced_work(mirrored, rows)
    finish = _one_trace.finisher(mirrored, keys)
    out = []
    with _scope.replica_scope(mirrored):
        for r, (device, (shard, offset, shard_rows)) in enumerate(
                zip(mirrored.devices, _shards(mirrored, packed, rows))):
            xr, yr, swr = mirrored._unpack(shard, present)
            with tf.device(device):
                (y_pred, loss, contribution), g, updates = work(
                    trainable, non_trainable, xr, yr, swr,
                    tf.constant(r, tf.int32), tf.cast(shard_rows, tf.int32),
                    tf.cast(offset, tf.int32), scale)
                if r == 0:
                    kept = updates
                # Replica 0's rows are never empty: its guard is a no-op.
                g, stats = finish(g, loss, shard_rows, swr, start)
                stats = stats, (arithmetic.stats_row(stats, keys) if keys
                                else None)
            out.append((g, contribution, stats, y_pred, None))
    _xla.assign(inner.non_trainable_variables, kept)
    return out


def _stats(keys, start, grads, loss, rows, sw):
    """`(statistics, their packed row)` of one replica, on its device.

    The row (`arithmetic.stats_row`) is the one tensor of statistics that
    goes to the first device; `None` without statistics.
    """
    stats = arithmetic.compute_stats(keys, start, grads, loss, rows, sw)
    return stats, arithmetic.stats_row(stats, keys) if keys else None


def _skip_unless_finite(optimizer, reduced, variables, packed, keys):
    """The optimizer update, skipped when any replica counted a NaN/Inf.

    The counts are read from the packed statistics (a column of float32
    counts: their sum is 0 exactly when every count is).
    """
    def apply():
        optimizer.apply(reduced, variables)
        return tf.constant(True)

    nonfinite = tf.reduce_sum(packed[:, keys.index("replica_nonfinite")])
    tf.cond(tf.equal(nonfinite, 0.0), apply, lambda: tf.constant(False))


def _replicas(mirrored, *args):
    return _one_trace.run(mirrored, lambda: _replicas_traced(mirrored, *args),
                          lambda: _replicas_eager(mirrored, *args))


def train_step(mirrored, data):
    x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
    rows = arithmetic.batch_rows(x)
    packed, present = mirrored._pack(x, y, sw)
    inner = mirrored._inner
    optimizer = inner.optimizer
    variables = inner.trainable_weights
    keys = mirrored._stat_keys()
    start, packed = arithmetic.step_start(packed, keys)
    grads, contributions, stats, preds, masks = zip(*_replicas(
        mirrored, packed, present, rows, keys, start))
    home = mirrored.devices[0]
    with tf.device(home):
        packed_stats = tf.stack([row for _, row in stats]) if keys else None
    reduced = _sum_gradients(grads, variables, mirrored._gradient_dtype,
                             home)
    with tf.device(home):
        loss = tf.add_n(contributions)
        if mirrored.on_nonfinite == "warn":
            optimizer.apply(reduced, variables)
        else:
            _skip_unless_finite(optimizer, reduced, variables, packed_stats,
                                keys)
        y_pred = _concat(list(preds), rows, list(masks))
        logs = mirrored._track(x, y, y_pred, sw, loss, rows)
        if packed_stats is not None:
            logs[_replica_logs.PACKED] = packed_stats
    return logs


def test_step(mirrored, data):
    x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
    rows = arithmetic.batch_rows(x)
    packed, present = mirrored._pack(x, y, sw)
    shards = _forward(mirrored, packed, present, rows, False)
    counts, total = _shares([s.mask for s in shards],
                            [s.rows for s in shards], rows)
    contributions = []
    for r, shard in enumerate(shards):
        with tf.device(shard.device):
            contributions.append(_contribution(
                mirrored, shard.loss, shard.extras, counts[r], total, r == 0,
                shard.rows))
    with tf.device(mirrored.devices[0]):
        y_pred = _concat([s.y_pred for s in shards], rows,
                         [s.mask for s in shards])
        return mirrored._track(x, y, y_pred, sw, tf.add_n(contributions),
                               rows)


def predict_step(mirrored, data):
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    preds = []
    rows = arithmetic.batch_rows(x)
    with _scope.replica_scope(mirrored):
        for r, (device, (shard, offset, shard_rows)) in enumerate(
                zip(mirrored.devices, _shards(mirrored, x, rows))):
            with tf.device(device), _context(
                    mirrored, r, shard_rows, rows, offset):
                preds.append(mirrored._inner(shard, training=False))
    with tf.device(mirrored.devices[0]):
        return _concat(preds, rows)
