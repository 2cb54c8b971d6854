"""The exact replica steps: train, test and predict on split global batches.

Semantics (see README, "Exactness"): replica `r` receives `b_r` of the `B`
rows of the global batch. It computes the loss of its shard exactly as one
device would on those rows, `S_r` (compiled loss plus `model.losses`), and
contributes `(S_r - W) * b_r / B + W * [r == 0]`, where `W` is the weight
regularisation, which depends on no data and so counts once. For Keras's
default `sum_over_batch_size` reduction the contributions sum to the loss
one device computes on the whole global batch, so the all-reduced gradient
sum is the single-device gradient.
"""


import warnings

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import allreduce
from keras_mirror import split
from keras_mirror.callbacks import _replica_logs
from keras_mirror.replica_context import ReplicaContext
from keras_mirror.replica_context import activate
from keras_mirror.steps import _reductions
from keras_mirror.steps import _scope

REPLICA_KEYS = _replica_logs.STAT_KEYS


def _first_leaf(structure):
    return next(t for t in tf.nest.flatten(structure) if t is not None)


def _batch_size(x):
    return tf.shape(_first_leaf(x))[0]


def _dynamic_rows(t):
    """`t` with its row count hidden from static shape inference.

    A shard whose row count is statically 0 would make Keras skip the loss
    reduction (`reduce_values` returns a (0,)-shaped tensor unreduced).
    """
    shape = [None] + t.shape.as_list()[1:]
    return tf.compat.v1.placeholder_with_default(t, shape=shape)


def _weight_regularization(model):
    """Sum of the variables' regularisers, as Keras adds them to `losses`."""
    terms = [
        v.regularizer(v)
        for v in model.trainable_weights
        if v.regularizer is not None
    ]
    if not terms:
        return tf.zeros((), tf.float32)
    return tf.add_n([tf.cast(t, tf.float32) for t in terms])


def _count_nonfinite(tensors):
    counts = [
        tf.reduce_sum(tf.cast(~tf.math.is_finite(tf.convert_to_tensor(t)),
                              tf.int32))
        for t in tensors
        if t is not None and tf.as_dtype(t.dtype).is_floating
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
        return start, tf.nest.map_structure(tf.identity, data)


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
    share = tf.math.divide_no_nan(tf.cast(rows, tf.float32),
                                  tf.cast(global_rows, tf.float32))
    first = tf.cast(is_first, tf.float32)
    # An empty shard's own loss may be NaN (a mean over no rows in a
    # `compute_loss` override); its share is 0 either way.
    weighted = tf.where(share > 0, (shard_loss - reg) * share,
                        tf.zeros_like(share))
    return weighted + reg * first


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
    if sw is None:
        return tf.cast(rows, tf.float32)
    return tf.add_n([tf.reduce_sum(tf.cast(w, tf.float32))
                     for w in tf.nest.flatten(sw)])


def pack_stats(per_replica, keys=REPLICA_KEYS):
    """The replicas' statistics as one float32 `[replicas, keys]` matrix.

    `per_replica` holds one dict of scalars per replica, with at least
    `keys` (the model's `_stat_keys()`); the matrix goes into the logs
    under `_replica_logs.PACKED` (see there for why one tensor).
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


class ReplicaSteps:
    """Mixin of `MirroredModel` holding its `train/test/predict_step`."""

    # -- splitting ---------------------------------------------------------

    def _plan_sizes(self, batch_size):
        return split.sizes_tensor(batch_size, self.num_replicas,
                                  self._capacity)

    def _distribute(self, data, sizes):
        """Slices each leaf of `data` into the replicas' shards."""
        offsets = split.offsets_tensor(sizes)

        def shard(ctx):
            r = ctx.replica_id_in_sync_group
            return tf.nest.map_structure(
                lambda t: _dynamic_rows(t[offsets[r]:offsets[r] + sizes[r]]),
                data)

        return self._strategy.experimental_distribute_values_from_function(
            shard)

    def _gather(self, per_replica):
        """Concatenates per-replica tensors (a structure) in replica order."""
        if self._multi_worker:
            # `gather` runs in the strategy's cross-replica context; it
            # concatenates every worker's replicas in global replica order.
            with self._strategy.scope():
                return tf.nest.map_structure(
                    lambda v: self._strategy.gather(v, axis=0), per_replica)
        local = self._strategy.experimental_local_results(per_replica)
        return tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *local)


    def _first(self, per_replica):
        return self._strategy.experimental_local_results(per_replica)[0]

    def _in_graph_shards(self, data, rows):
        """`data`'s shards, each sliced on its replica's device (in_graph)."""
        if len(self._devices) == 1:  # the plan is the whole batch
            return [data]
        sizes = self._plan_sizes(rows)
        offsets = split.offsets_tensor(sizes)
        shards = []
        for r, device in enumerate(self._devices):
            with tf.device(device):
                shards.append(tf.nest.map_structure(
                    lambda t, r=r: _dynamic_rows(
                        t[offsets[r]:offsets[r] + sizes[r]]), data))
        return shards

    @staticmethod
    def _pack(x, y, sw):
        """Drops the None parts; returns (present parts, which were there)."""
        parts = (x, y, sw)
        present = tuple(p is not None for p in parts)
        return tuple(p for p in parts if p is not None), present

    @staticmethod
    def _unpack(packed, present):
        it = iter(packed)
        return tuple(next(it) if p else None for p in present)

    def _context(self, global_rows, x, offsets):
        """Makes `replica_context()` describe this replica in its step."""
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return activate(ReplicaContext(
            r, self.num_replicas, _batch_size(x), global_rows,
            distributed=True, options=self._comm_options,
            gradient_dtype=self._gradient_dtype,
            offset=tf.gather(offsets, r)))

    # -- losses ------------------------------------------------------------

    def _replica_loss(self, x, y, y_pred, sw, training, global_rows,
                      mask=None):
        """Returns (contribution to the global loss, shard loss)."""
        ctx = tf.distribute.get_replica_context()
        # Losses are not divided by the replica count in a step
        # (`_compat.unscaled_losses`): this is one device's loss of the shard.
        shard = tf.cast(_reductions.compute_loss(
            self._inner, x, y, y_pred, sw, training), tf.float32)
        first = tf.equal(ctx.replica_id_in_sync_group, 0)
        if mask is None:
            count, total = _batch_size(x), global_rows
        else:
            count = unmasked_entries(mask)
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, count)
        return self._contribution(shard, count, total, first), shard

    def _contribution(self, shard, count, total, first):
        """`contribution` with the batch-sum terms (`_reductions`) unweighted.
        """
        reductions = getattr(self, "_reductions", None)
        summed = (reductions.sum_terms(shard, self._inner.losses)
                  if reductions is not None else 0.0)
        reg = _weight_regularization(self._inner)
        return contribution(shard - summed, reg, count, total, first) + summed

    def _with_mask(self, y_pred, mask):
        """`(y_pred, its mask)` to gather, noting whether there is one."""
        self._output_masked = mask is not None
        return (y_pred, mask) if mask is not None else y_pred

    def _gather_predictions(self, y_pred):
        gathered = self._gather(y_pred)
        if getattr(self, "_output_masked", False):
            return with_mask(*gathered)
        return gathered

    def _track(self, x, y, y_pred, sw, loss, rows):
        """The global loss and metrics, on one device, as Keras logs them."""
        tracker = _compat.loss_tracker(self._inner)
        if tracker is not None:
            tracker.update_state(loss, sample_weight=rows)
        return dict(self._inner.compute_metrics(x, y, y_pred,
                                                sample_weight=sw))

    # -- train -------------------------------------------------------------

    def _replica_train(self, packed, present, global_rows, start, offsets):
        x, y, sw = self._unpack(packed, present)
        rows = _batch_size(x)
        keys = self._stat_keys()
        variables = self._inner.trainable_weights
        optimizer = self._inner.optimizer
        with tf.GradientTape() as tape, self._context(global_rows, x,
                                                      offsets):
            y_pred = self._inner(x, training=True)
            mask = output_mask(y_pred)
            contribution, shard = self._replica_loss(
                x, y, y_pred, sw, True, global_rows, mask)
            scaled = optimizer.scale_loss(contribution)
        grads = zero_if_empty(tape.gradient(scaled, variables), rows)
        stats = compute_stats(keys, start, grads, shard, rows, sw)
        reduced = allreduce.all_reduce_sum(
            grads, self._comm_options, self._gradient_dtype)
        ctx = tf.distribute.get_replica_context()
        if self.on_nonfinite == "warn":
            optimizer.apply(reduced, variables)
        else:
            total_nonfinite = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                             stats["replica_nonfinite"])
            self._apply(reduced, variables, total_nonfinite)
        loss = ctx.all_reduce(tf.distribute.ReduceOp.SUM, contribution)
        packed = pack_stats([stats], keys) if keys else None
        return self._with_mask(y_pred, mask), loss, packed

    def _apply(self, grads, variables, total_nonfinite):
        """Applies the all-reduced gradients once, or skips a bad step.

        For `on_nonfinite` "skip_step" and "raise": a non-finite value on
        any replica skips the update on all of them.
        """

        def cross_replica(strategy, grads, total):
            finite = tf.equal(
                strategy.experimental_local_results(total)[0], 0)

            def apply_on_each():
                strategy.extended.call_for_each_replica(
                    lambda g: self._inner.optimizer.apply(g, variables),
                    args=(grads,))

            # A cond whose branch calls `merge_call` must run in the
            # cross-replica context (as Keras's LossScaleOptimizer does).
            tf.cond(finite, apply_on_each, lambda: None)

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(grads, total_nonfinite))

    def train_step(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        rows = _batch_size(x)
        packed, present = self._pack(x, y, sw)
        start, packed = step_start(packed, self._stat_keys())
        sizes = self._plan_sizes(rows)
        shards = self._distribute(packed, sizes)
        offsets = split.offsets_tensor(sizes)
        with _scope.replica_scope(self):
            y_pred, loss, stats = self._strategy.run(
                self._replica_train,
                args=(shards, present, rows, start, offsets))
        self._sync_state()
        y_pred = self._gather_predictions(y_pred)
        logs = self._track(x, y, y_pred, sw, self._first(loss), rows)
        if stats is not None:
            logs[_replica_logs.PACKED] = self._gather(stats)
        return logs

    def _sync_state(self):
        """Copies replica 0's non-trainable state to the other replicas.

        Each replica writes its own copy of state such as BatchNorm's
        moving statistics (TF's mirrored variables with aggregation
        "none"); Keras reads, saves and checkpoints the first copy. Copying
        it to the others keeps every replica's evaluation and prediction on
        the same state (the `in_graph` path's semantics), and keeps the NaN
        statistics of an empty shard from surviving the step.
        """
        for v in self._inner.non_trainable_variables:
            copies = self._strategy.experimental_local_results(v.value)
            for copy in copies[1:]:
                copy.assign(copies[0])

    # -- test and predict --------------------------------------------------

    def _replica_test(self, packed, present, global_rows, offsets):
        x, y, sw = self._unpack(packed, present)
        with self._context(global_rows, x, offsets):
            y_pred = self._inner(x, training=False)
            mask = output_mask(y_pred)
            contribution, shard = self._replica_loss(
                x, y, y_pred, sw, False, global_rows, mask)
        ctx = tf.distribute.get_replica_context()
        loss = ctx.all_reduce(tf.distribute.ReduceOp.SUM, contribution)
        return self._with_mask(y_pred, mask), loss

    def test_step(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        rows = _batch_size(x)
        packed, present = self._pack(x, y, sw)
        sizes = self._plan_sizes(rows)
        shards = self._distribute(packed, sizes)
        offsets = split.offsets_tensor(sizes)
        with _scope.replica_scope(self):
            y_pred, loss = self._strategy.run(
                self._replica_test, args=(shards, present, rows, offsets))
        y_pred = self._gather_predictions(y_pred)
        return self._track(x, y, y_pred, sw, self._first(loss), rows)

    def _replica_predict(self, x, global_rows, offsets):
        with self._context(global_rows, x, offsets):
            return self._inner(x, training=False)

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        rows = _batch_size(x)
        sizes = self._plan_sizes(rows)
        shards = self._distribute(x, sizes)
        offsets = split.offsets_tensor(sizes)
        with _scope.replica_scope(self):
            out = self._strategy.run(self._replica_predict,
                                     args=(shards, rows, offsets))
        return self._gather(out)
