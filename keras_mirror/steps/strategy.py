"""The one execution path: one replica step per device, on tf.distribute.

`ReplicaSteps` is the `tf.distribute` half of `MirroredModel`'s steps: the
global batch is split by the plan (`split`), each replica runs its shard
under `strategy.run` on its own copy of the variables, the loss
contributions (`arithmetic.contribution`) are differentiated per replica and
the gradients summed by one explicit all-reduce (`allreduce`), then
applied once.
"""

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import allreduce
from keras_mirror import split
from keras_mirror.distribute import _rows
from keras_mirror.replica_context import ReplicaContext
from keras_mirror.replica_context import activate
from keras_mirror.replica_context import active
from keras_mirror.steps import _one_trace
from keras_mirror.steps import _one_update
from keras_mirror.steps import _own_rows
from keras_mirror.steps import _reductions
from keras_mirror.steps import _replica_stats
from keras_mirror.steps import _scope
from keras_mirror.steps import _stand_in
from keras_mirror.steps import _xla
from keras_mirror.steps import arithmetic


def _real_rows_of(sizes):
    """This replica's rows of the plan `sizes` (0: a stand-in row)."""
    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.cast(tf.gather(sizes, r), tf.int32)


class ReplicaSteps:
    """Mixin of `MirroredModel` holding its `train/test/predict_step`."""

    # -- splitting ---------------------------------------------------------

    def _plan_sizes(self, batch_size):
        return split.sizes_tensor(
            batch_size, self._strategy.num_replicas_in_sync,
            self._step_state.capacity)

    def _distribute(self, data, sizes, multiple=1):
        """Slices each leaf of `data` into the replicas' shards.

        An empty shard gets one stand-in row (`_stand_in`); with `multiple`
        2, each shard is padded to an even number of rows.
        """
        starts, runs = _stand_in.bounds(sizes, multiple)
        total = tf.reduce_sum(sizes) if multiple > 1 else None

        def shard(ctx):
            r = ctx.replica_id_in_sync_group
            return tf.nest.map_structure(
                lambda t: _stand_in.shard(t, starts[r], runs[r], total),
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

    def _context(self, global_rows, sizes, r=None, traced_once=None,
                 compiled=False, multiple=1):
        """Makes `replica_context()` describe this replica in its step.

        Its shard size is the plan's (0 for a stand-in replica, whose
        tensors hold one row). `r`: the replica id as a tensor argument of
        a function traced once for all replicas (else TF's, a constant).
        `multiple`: the step's padding (`_distribute`).
        """
        if r is None:
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
        run_rows = None
        if multiple > 1:
            run_rows = tf.gather(_stand_in.bounds(sizes, multiple)[1], r)
        return activate(ReplicaContext(
            r, self._strategy.num_replicas_in_sync, tf.gather(sizes, r),
            global_rows,
            distributed=True, options=self._comm_options,
            gradient_dtype=self._gradient_dtype,
            offset=tf.gather(split.offsets_tensor(sizes), r),
            traced_once=traced_once, compiled=compiled, run_rows=run_rows))

    @staticmethod
    def _real_rows():
        """This replica's rows of the plan (0: it runs a stand-in row)."""
        return tf.cast(active().shard_size, tf.int32)

    def _replica_work(self, x, y, sw, global_rows, training=True,
                      multiple=1, traced_once=False):
        """A replica's forward pass and loss on its shard: the one function
        of the built-in steps (train: under a tape, or traced once for all
        replicas; test: as is). Returns `(y_pred, sw, mask, contribution,
        shard)`, a padded shard's stand-in rows cut off. A masked output's
        shares need an all-reduce: a single trace notes it (`_one_trace`)
        and the step then traces per replica."""
        y_pred = self._inner(x, training=training)
        if multiple > 1:
            x, y, y_pred, sw = _stand_in.unpadded((x, y, y_pred, sw),
                                                  self._real_rows())
        mask = arithmetic.output_mask(y_pred)
        if mask is not None and traced_once:
            _one_trace.note(_xla.MASKED)
            mask = None
        contribution, shard = self._replica_loss(
            x, y, y_pred, sw, training, global_rows, mask)
        return y_pred, sw, mask, contribution, shard

    # -- losses ------------------------------------------------------------

    def _replica_loss(self, x, y, y_pred, sw, training, global_rows,
                      mask=None):
        """Returns (contribution to the global loss, shard loss)."""
        ctx = tf.distribute.get_replica_context()
        rows = self._real_rows()
        # Losses are not divided by the replica count in a step
        # (`_compat.unscaled_losses`): this is one device's loss of the shard.
        shard, parts = _reductions.compute_loss(
            self._inner, x, y, y_pred, sw, training,
            self._step_state.reductions)
        first = tf.equal(active().replica_id, 0)
        if mask is None:
            count, total = rows, global_rows
        else:
            count = tf.where(rows > 0, arithmetic.unmasked_entries(mask), 0.0)
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                   allreduce._cut(count))
        return self._contribution(shard, parts, count, total, first,
                                  rows), shard

    def _contribution(self, shard, parts, count, total, first, rows):
        """`arithmetic.contribution`, each term by its kind (`_reductions`).

        A stand-in replica (`rows` 0) contributes nothing but, on replica
        0, the weight regularisation.
        """
        return _reductions.weighted(
            self._step_state.reductions, self._inner, shard,
            self._inner.losses, count, total, first, rows, parts)

    def _with_mask(self, y_pred, mask):
        """`(y_pred, its mask)` to gather, noting whether there is one."""
        self._step_state.output_masked = mask is not None
        return (y_pred, mask) if mask is not None else y_pred

    def _gather_predictions(self, y_pred):
        gathered = self._gather(y_pred)
        if self._step_state.output_masked:
            return arithmetic.with_mask(*gathered)
        return gathered

    def _track(self, x, y, y_pred, sw, loss, rows):
        """The global loss and metrics, on one device, as Keras logs them."""
        tracker = _compat.loss_tracker(self._inner)
        if tracker is not None:
            tracker.update_state(loss, sample_weight=rows)
        return dict(self._inner.compute_metrics(x, y, y_pred,
                                                sample_weight=sw))

    # -- train -------------------------------------------------------------

    def _traced_work(self, global_rows, multiple=1):
        """A replica's forward pass, loss and gradients, traced once.

        One function (`_one_trace`; XLA-compiled with `jit_compile`) that
        every replica calls in its context with its copies of the
        variables' values, its shard and its id; a masked output (its
        shares need an all-reduce) is noted while tracing (`_one_trace.note`)
        and the step's work then traced per replica.
        """
        compiled = _one_trace.decide(self).xla

        def body(trial, x, y, sw, sizes, r, scale):
            with self._context(global_rows, sizes, r, traced_once=trial,
                               compiled=compiled, multiple=multiple):
                y_pred, _, _, contribution, shard = self._replica_work(
                    x, y, sw, global_rows, multiple=multiple,
                    traced_once=True)
            return (y_pred, contribution, shard), contribution * tf.cast(
                scale, contribution.dtype)

        return _one_trace.replica_work(self, body, shards=(0, 1, 2))

    def _replica_traced(self, work, x, y, sw, global_rows, sizes):
        """The traced-once work's results, or None where its trace cannot
        serve (the reason, noted while tracing, is logged once)."""
        inner = self._inner
        scale = tf.cast(inner.optimizer.scale_loss(tf.ones((), tf.float32)),
                        tf.float32)
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        args = (_xla.values(inner.trainable_variables),
                _xla.values(inner.non_trainable_variables), x, y, sw, sizes,
                tf.cast(r, tf.int32), scale)
        reason = work.prepare(*args)
        if reason is not None:
            _one_trace.turn_off(self, reason)
            return None
        (y_pred, contribution, shard), grads, updates = work(*args)
        _xla.assign(inner.non_trainable_variables, updates)
        return y_pred, contribution, shard, None, grads

    def _replica_train(self, packed, present, global_rows, start, sizes,
                       multiple, traced=None):
        x, y, sw = self._unpack(packed, present)
        keys = self._stat_keys()
        variables = self._inner.trainable_weights
        optimizer = self._inner.optimizer
        done = traced and self._replica_traced(traced[0], x, y, sw,
                                               global_rows, sizes)
        if done:  # the work and the finish (`traced`), each traced once
            y_pred, contribution, shard, mask, grads = done
            rows = _real_rows_of(sizes)
            sw = _stand_in.real_rows(sw, rows)
            grads, stats = traced[1](grads, shard, rows, sw, start)
        else:
            with tf.GradientTape() as tape, self._context(
                    global_rows, sizes, multiple=multiple):
                rows = self._real_rows()
                y_pred, sw, mask, contribution, shard = self._replica_work(
                    x, y, sw, global_rows, multiple=multiple)
                scaled = optimizer.scale_loss(contribution)
            grads = tape.gradient(scaled, variables)
            grads = arithmetic.zero_if_empty(grads, rows)
            sw = _stand_in.real_rows(sw, rows)
            stats = arithmetic.compute_stats(keys, start, grads, shard, rows,
                                             sw)
        reduced = allreduce.all_reduce_sum(
            grads, self._comm_options, self._gradient_dtype)
        ctx = tf.distribute.get_replica_context()
        finite = None
        if self.on_nonfinite != "warn":
            finite = tf.equal(ctx.all_reduce(
                tf.distribute.ReduceOp.SUM,
                allreduce._cut(stats["replica_nonfinite"])), 0)
        self._apply(reduced, variables, finite)
        loss = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                              allreduce._cut(contribution))
        packed = arithmetic.pack_stats([stats], keys) if keys else None
        y_pred, mask = _stand_in.real_rows((y_pred, mask), rows)
        return self._with_mask(y_pred, mask), loss, packed

    def _apply(self, grads, variables, finite=None):
        """Applies the all-reduced gradients once, on every replica.

        With `finite` (`on_nonfinite` "skip_step" and "raise"), a False (a
        non-finite value on any replica) skips the update on all of them.
        The optimizer's own update, traced once for all replicas
        (`_one_update`); where that cannot serve (the reason logged once),
        the optimizer's stock `apply`, as Keras runs it.
        """
        if _one_update.apply(self, grads, variables, finite):
            return
        optimizer = self._inner.optimizer
        if finite is None:
            optimizer.apply(grads, variables)
            return

        def cross_replica(strategy, grads, finite):
            def apply_on_each():
                strategy.extended.call_for_each_replica(
                    lambda g: optimizer.apply(g, variables), args=(grads,))

            # A cond whose branch calls `merge_call` must run in the
            # cross-replica context (as Keras's LossScaleOptimizer does).
            tf.cond(strategy.experimental_local_results(finite)[0],
                    apply_on_each, lambda: None)

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(grads, finite))

    def _shards_of(self, per_replica):
        """`(shards, sizes, rows)` of replicas' own rows (`_own_rows`)."""
        return _own_rows.shards_of(self._strategy, per_replica)

    def train_step(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        packed, present = self._pack(x, y, sw)
        own_rows = _rows.is_per_replica(packed)
        if own_rows:
            # Each replica's rows as it received them: not padded (the rows
            # after a shard are another worker's); see docs/onednn.md.
            multiple = 1
            start = tf.timestamp() if "replica_step_time" in \
                self._stat_keys() else None
            shards, sizes, rows = self._shards_of(packed)
        else:
            rows = arithmetic.batch_rows(x)
            start, packed = arithmetic.step_start(packed, self._stat_keys())
            sizes = self._plan_sizes(rows)
            # An XLA-compiled replica work runs XLA's convolutions, not
            # oneDNN's kernels (and cannot cut a padded shard): no padding.
            multiple = 1 if _one_trace.decide(self).xla else (
                _stand_in.row_multiple(self._inner, self._devices,
                                       self._step_state.reductions))
            shards = self._distribute(packed, sizes, multiple)
        y_pred, loss, stats = self._run_train(shards, present, rows, start,
                                              sizes, multiple, packed)
        self._sync_state()
        y_pred = self._gather_predictions(y_pred)
        if own_rows:
            x, y, sw = _own_rows.targets_of(self, packed, present)
        logs = self._track(x, y, y_pred, sw, self._first(loss), rows)
        if stats is not None:
            logs[_replica_stats.PACKED] = self._gather(stats)
        return logs

    def _run_train(self, shards, present, rows, start, sizes, multiple=1,
                   data=None):
        """`strategy.run` of the replica step, its work traced once (and
        XLA-compiled) where it can be (`_one_trace`)."""
        args = (shards, present, rows, start, sizes, multiple)
        with _scope.replica_scope(self):
            return _one_trace.run(
                self,
                lambda: self._strategy.run(
                    self._replica_train,
                    args=args + ((self._traced_work(rows, multiple),
                                  _one_trace.finisher(self, self._stat_keys())
                                  ),)),
                lambda: self._strategy.run(self._replica_train, args=args),
                data)

    def _sync_state(self):
        """Copies replica 0's non-trainable state to the other replicas.

        Each replica writes its own copy of state such as BatchNorm's
        moving statistics (TF's mirrored variables with aggregation
        "none"); Keras reads, saves and checkpoints the first copy. Copying
        it to the others keeps every replica's evaluation and prediction on
        the same state, and keeps the NaN
        statistics of an empty shard from surviving the step.
        """
        for v in self._inner.non_trainable_variables:
            copies = self._strategy.experimental_local_results(v.value)
            for copy in copies[1:]:
                copy.assign(copies[0])

    # -- test and predict --------------------------------------------------

    def _replica_test(self, packed, present, global_rows, sizes):
        x, y, sw = self._unpack(packed, present)
        with self._context(global_rows, sizes):
            rows = self._real_rows()
            y_pred, _, mask, contribution, _ = self._replica_work(
                x, y, sw, global_rows, training=False)
        ctx = tf.distribute.get_replica_context()
        loss = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                              allreduce._cut(contribution))
        y_pred, mask = _stand_in.real_rows((y_pred, mask), rows)
        return self._with_mask(y_pred, mask), loss

    def test_step(self, data):
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        rows = arithmetic.batch_rows(x)
        packed, present = self._pack(x, y, sw)
        sizes = self._plan_sizes(rows)
        shards = self._distribute(packed, sizes)
        with _scope.replica_scope(self):
            y_pred, loss = self._strategy.run(
                self._replica_test, args=(shards, present, rows, sizes))
        y_pred = self._gather_predictions(y_pred)
        return self._track(x, y, y_pred, sw, self._first(loss), rows)

    def _replica_predict(self, x, global_rows, sizes):
        with self._context(global_rows, sizes):
            return _stand_in.real_rows(self._inner(x, training=False),
                                       self._real_rows())

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        rows = arithmetic.batch_rows(x)
        sizes = self._plan_sizes(rows)
        shards = self._distribute(x, sizes)
        with _scope.replica_scope(self):
            out = self._strategy.run(self._replica_predict,
                                     args=(shards, rows, sizes))
        return self._gather(out)
