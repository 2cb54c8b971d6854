"""`replica_context()`: the replica's view of the global batch in a step.

A model that overrides `train_step` (or `test_step`) runs that step once per
replica under `MirroredModel`, on the replica's shard of the global batch;
the built-in step runs the model's forward pass once per replica too.
`keras_mirror.replica_context()` tells the step (or a layer's `call`) where
it is: which replica,
how many rows it holds, how many rows the global batch has, and its share
`b_r / B`. The two reduction helpers are exact: `all_reduce_mean` weights
each replica's value by its share, so the mean of per-shard means is the
mean over the global batch, for uneven and empty shards too.

Outside `MirroredModel` (plain Keras, one device) the same calls describe a
single replica holding the whole batch, so one step function serves both.
"""

import contextlib
import threading

# TensorFlow is imported where it is used: `keras_mirror/__init__.py` binds
# `keras_mirror.replica_context` (the function) eagerly, because the name is
# also this module's, and the package must not load TensorFlow on import.

_LOCAL = threading.local()


class ReplicaContext:
    """One replica's place in the global batch, inside a training step.

    Obtained from `keras_mirror.replica_context()`; not created by users.
    Values are tensors inside a `MirroredModel` step (they are known only
    when the step runs) and Python numbers or None outside one.

    Attributes:
        distributed: bool. True inside a `MirroredModel` replica step (with
            any replica count), False outside.
        replica_id: int or scalar int32 tensor. The replica's index, 0 to
            `num_replicas - 1`, in split-plan order.
        num_replicas: int. Replicas in sync.
        shard_size: int, scalar int32 tensor or None. Rows of the global
            batch that this replica holds, `b_r` (may be 0: an empty shard
            runs one stand-in row, the global batch's first, so that no
            kernel sees 0 rows; it counts for nothing: share 0, no metric
            update, 0 in `all_reduce_sum`, left out of synchronized
            BatchNorm's statistics).
        global_batch_size: int, scalar int32 tensor or None. Rows of the
            global batch, `B`.
        share: float or scalar float32 tensor. `b_r / B` (0 for an empty
            shard; 1 outside `MirroredModel`).
        offset: int, scalar int32 tensor or None. The replica's first row
            in the global batch (0 outside `MirroredModel`, and for an
            empty shard, whose stand-in row is the global batch's first).

    Example:

    ```python
    def train_step(self, data):
        ctx = keras_mirror.replica_context()
        ...
        # The global-batch mean of a per-shard mean statistic:
        d_acc = ctx.all_reduce_mean(shard_accuracy)
    ```
    """

    def __init__(self, replica_id, num_replicas, shard_size,
                 global_batch_size, distributed=False, options=None,
                 gradient_dtype=None, offset=None,
                 shares_after_gradient=False, traced_once=None,
                 compiled=False, run_rows=None):
        self.replica_id = replica_id
        # The rows the replica's model runs where a shard is padded with
        # stand-in rows (`steps/_stand_in.py`, oneDNN), else None.
        self._run_rows = run_rows
        # Inside an XLA-compiled replica function: shapes must be known when
        # it compiles (`steps/_random.py` draws the global batch's rows).
        self._compiled = compiled
        # Inside the built-in step's work traced once for all replicas, where
        # no replica can wait for another: that trace's `_one_trace.Trial`.
        self._traced_once = traced_once
        # A model's own step: each replica's gradients are weighted by its
        # share when applied (`own_step`), not its loss before.
        self._shares_after_gradient = shares_after_gradient
        # Within an own step's optimizer's own `apply`, called with the
        # global gradient (`own_step.applied_globally`): a nested `apply`
        # (a `LossScaleOptimizer`'s inner one) is the optimizer's own.
        self._applying = False
        self.offset = offset
        self.num_replicas = num_replicas
        self.shard_size = shard_size
        self.global_batch_size = global_batch_size
        self.distributed = distributed
        self._options = options
        self._gradient_dtype = gradient_dtype
        if distributed:
            import tensorflow as tf

            if offset is not None and shard_size is not None:
                # An empty shard's stand-in row is the global batch's first.
                self.offset = tf.where(
                    tf.cast(shard_size, tf.int32) > 0,
                    tf.cast(offset, tf.int32), 0)
            # In float64, rounded once to the dtype it weighs (`share_in`).
            self._share64 = tf.math.divide_no_nan(
                tf.cast(shard_size, tf.float64),
                tf.cast(global_batch_size, tf.float64))
            self.share = tf.cast(self._share64, tf.float32)
        else:
            self.share = 1.0

    def share_in(self, dtype):
        """`share` in `dtype`: float64 models weigh by a float64 share."""
        import tensorflow as tf

        if not self.distributed:
            return tf.ones((), dtype)
        return tf.cast(self._share64, dtype)

    def weight(self, value):
        """`value * share`, and exactly 0 on an empty shard (never NaN)."""
        if not self.distributed:
            return value
        import tensorflow as tf

        if isinstance(value, tf.IndexedSlices):  # sparse stays sparse
            return tf.IndexedSlices(self.weight(value.values), value.indices,
                                    value.dense_shape)
        value = tf.convert_to_tensor(value)
        share = self.share_in(value.dtype)
        return tf.where(share > 0, value * share, tf.zeros_like(value))

    def all_reduce_sum(self, value):
        """Sums `value` (a tensor or a structure of them) over replicas."""
        if not self.distributed or self._unserved_in_one_trace():
            return value
        import tensorflow as tf

        # An empty shard runs a stand-in row (`steps/_stand_in.py`): it adds
        # nothing to the sum.
        rows = tf.cast(self.shard_size, tf.int32)
        return tf.nest.map_structure(
            lambda v: summed(tf.where(rows > 0, v, tf.zeros_like(v))),
            value)

    def all_reduce_mean(self, value):
        """The share-weighted sum over replicas: the global-batch mean.

        `value` is this replica's mean over its own shard (a per-batch mean
        loss or statistic); the result is the mean over the global batch,
        the value one device would compute. Empty shards contribute 0.
        """
        if not self.distributed:
            return value
        import tensorflow as tf

        return self.all_reduce_sum(tf.nest.map_structure(self.weight, value))

    def all_gather(self, value):
        """The global batch's rows of `value`: every replica's, in order.

        `value` has this replica's rows (`shard_size`, leading dimension);
        the result has the global batch's `global_batch_size` rows, replica
        0's first, the same on every replica: what one device computes on
        the whole batch. Row `i` of the shard is row `offset + i` of the
        result. Outside `MirroredModel`, `value` itself. Integer tensors
        (labels) are gathered without a gradient.

        Differentiable, so that a loss over the whole batch (in-batch
        negatives, NT-Xent, a CLIP-style similarity matrix) trains as on
        one device, for uneven and empty shards too. With `s_r = b_r / B`
        replica `r`'s share and `L_r` the loss its step computes, the step
        is exact when one device's loss is `L = sum_r s_r L_r`, which holds
        for the two usual forms:

        - `L_r` is the mean, over the shard's rows, of a per-row loss that
          scores each row against the gathered rows `Z` (InfoNCE, NT-Xent:
          a `[b_r, B]` block of one device's `[B, B]` matrix); or
        - `L_r = L(Z)`, the same whole-batch value on every replica
          (`sum_r s_r = 1`).

        A replica's tape reaches the weights `w` only through its own rows
        `z_q`, so one device's gradient must come to each replica as
        `sum_q (dL/dz_q) dz_q/dw`, where `dL/dz_q = sum_r s_r dL_r/dz_q`.
        keras-mirror sums the replicas' gradients weighted by their shares,
        `g = sum_q s_q g_q` (a model's own step weights them when they are
        applied; the built-in step differentiates `s_q L_q`). In the
        backward pass, replica `r` holds `U_r = dL_r/dZ` (all `B` rows);
        the gather all-reduces `sum_r s_r U_r` and replica `q` keeps rows
        `[offset_q, offset_q + b_q)`, divided by `s_q` in an own step (the
        built-in step's `U_r` carries `s_r` already, and nothing is
        divided). Weighted by `s_q` again, that is `sum_r s_r dL_r/dz_q`
        through `Z`, to which the replica's direct use of its rows adds
        `s_q dL_q/dz_q`: summed over `q`, one device's gradient. An empty
        shard (`s_q = 0`) gives no rows and gets a zero gradient.

        Example:

        ```python
        z = keras_mirror.replica_context().all_gather(embeddings)
        logits = ops.matmul(embeddings, ops.transpose(z))  # global negatives
        ```
        """
        if not self.distributed:
            return value
        if self._unserved_in_one_trace():
            return _stand_in_gather(self, value)
        return _gather(self, value)

    def _unserved_in_one_trace(self):
        """Whether this call is in work traced once for all replicas.

        No replica can wait for another inside one trace: the call notes
        why (`steps/_one_trace.note`) before TensorFlow sees it, returns a
        stand-in of the result's shape, and the trace it is in is dropped:
        the step then traces its work per replica, where the call runs.
        """
        if self._traced_once is None:
            return False
        note(CROSS_REPLICA_IN_ONE_TRACE)
        return True

    def __repr__(self):
        return (f"ReplicaContext(replica_id={self.replica_id}, "
                f"num_replicas={self.num_replicas}, "
                f"shard_size={self.shard_size}, "
                f"global_batch_size={self.global_batch_size})")


CROSS_REPLICA_IN_ONE_TRACE = (
    "the forward pass all-reduces across replicas, which no replica can "
    "wait for inside a function traced once for all replicas")


def note(reason):
    """Notes, while work is traced once for all replicas, that one trace
    cannot serve it: in that trace's `steps/_one_trace.Trial`, which its
    replica context holds (`Traced.prepare` then drops the trace)."""
    context = active()
    if context is None or context._traced_once is None:
        raise outside_one_trace(reason)
    context._traced_once.note(reason)


def outside_one_trace(reason):
    """The error for a `note` made where no single trace is being made."""
    return RuntimeError(
        f"keras-mirror: {reason}, outside the single trace of a replica's "
        "work. This is a bug in keras-mirror; please report it with the "
        "model.")


def _stand_in_gather(context, value):
    """Zeros shaped like `all_gather(value)`, for a trace to be dropped."""
    import tensorflow as tf

    value = tf.convert_to_tensor(value)
    if value.shape.rank == 0:
        return value
    rows = tf.cast(context.global_batch_size, tf.int32)
    return tf.zeros(tf.concat([[rows], tf.shape(value)[1:]], 0), value.dtype)


def _gather(context, value):
    """`all_gather` with its gradient routed back to each replica's rows."""
    import tensorflow as tf

    value = tf.convert_to_tensor(value)
    ctx = tf.distribute.get_replica_context()
    options = context._options

    def gather(t):
        return ctx.all_gather(t, axis=0, options=options)

    # An empty shard runs a stand-in row (`steps/_stand_in.py`): it gives
    # no rows, and gets a zero gradient.
    rows = tf.cast(context.shard_size, tf.int32)
    run_rows = tf.shape(value)[0]
    if not value.dtype.is_floating:
        return gather(value[:rows])
    offset = tf.cast(context.offset, tf.int32)
    share = context.share_in(value.dtype)

    @tf.custom_gradient
    def differentiable(t):
        def grad(upstream):
            upstream = tf.convert_to_tensor(upstream)
            # Weighted as the replica's loss would be, then unweighted: its
            # own step's gradients get its share when applied (not those
            # with respect to tensors only, `differentiating`).
            weighted = context._shares_after_gradient and not getattr(
                _LOCAL, "tensor_gradient", False)
            if weighted:
                upstream = context.weight(upstream)
            else:
                upstream = tf.where(rows > 0, upstream,
                                    tf.zeros_like(upstream))
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, upstream,
                                   options=options)
            mine = total[offset:offset + rows]
            if weighted:
                mine = tf.math.divide_no_nan(mine, share)
            stand_in = tf.zeros(tf.concat(
                [[run_rows - rows], tf.shape(mine)[1:]], 0), mine.dtype)
            return tf.concat([mine, stand_in], axis=0)

        return gather(t[:rows]), grad

    return differentiable(value)


def summed(value):
    """The sum of `value` over the replicas, exactly differentiable.

    Its gradient is TF's (the replicas' upstream gradients summed) where
    each replica's loss is share-weighted before differentiation (the
    built-in step). A model's own step weights its gradients after
    (`own_step`): there each replica's upstream gradient is weighted by its
    own share before the sum and the result divided by this replica's, so
    every term carries its own share; a gradient with respect to tensors
    only (`differentiating`) is one device's. `all_reduce_sum` and the
    global BatchNorm moments use it: exact for uneven and empty shards.

    The collective's input is cut from the graph behind it
    (`tf.stop_gradient`) and the gradient is this function's own. TF's
    `ReplicaContext.all_reduce` wraps its collective in a
    `tf.custom_gradient`, whose graph-mode bookkeeping walks back from the
    sum through every replica's graph behind it, at each call: with global
    BatchNorm (an all-reduce per layer) that walk made most of a
    convnet's first step. Cut at the inputs, each walk ends there.
    """
    context = active()
    return _summed(value, context is not None and
                   context._shares_after_gradient)


def _summed(value, weighted):
    """`summed`, its gradient weighted by the shares where `weighted`."""
    import tensorflow as tf

    context = active()
    ctx = tf.distribute.get_replica_context()
    options = None if context is None else context._options

    def reduce(t):
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                              tf.stop_gradient(t), options=options)

    value = tf.convert_to_tensor(value)
    if not value.dtype.is_floating:
        return reduce(value)
    share = context.share_in(value.dtype) if weighted else None

    @tf.custom_gradient
    def differentiable(t):
        def grad(upstream):
            upstream = tf.convert_to_tensor(upstream)
            if not weighted:
                # The gradient of a sum over replicas is one (TF's rule),
                # differentiable again (a gradient penalty's).
                return _summed(upstream, False)
            if getattr(_LOCAL, "tensor_gradient", False):
                # Not share-weighted later (a gradient penalty's): summed,
                # a stand-in replica's left out, and exact again.
                rows = tf.cast(context.shard_size, tf.int32)
                return summed(tf.where(rows > 0, upstream,
                                       tf.zeros_like(upstream)))
            total = _summed(context.weight(upstream), False)
            return tf.math.divide_no_nan(total, share)

        return reduce(t), grad

    return differentiable(value)


@contextlib.contextmanager
def differentiating(variables):
    """Within the block an own step's `tape.gradient` runs with respect to
    variables (share-weighted when applied) or tensors (`steps/_tape`)."""
    previous = getattr(_LOCAL, "tensor_gradient", False)
    _LOCAL.tensor_gradient = not variables
    try:
        yield
    finally:
        _LOCAL.tensor_gradient = previous


def replica_context(batch_size=None):
    """Returns the `ReplicaContext` of the step that is running.

    Inside a step that `MirroredModel` runs per replica (a user's own
    `train_step` or `test_step`), the context describes this replica's
    shard. Anywhere else it describes one replica holding the whole batch:
    `replica_id=0`, `num_replicas=1`, `share=1.0`, and the reductions return
    their argument, so the same step code runs under plain Keras.

    Args:
        batch_size: int or None. Outside `MirroredModel`, the rows of the
            batch (reported as `shard_size` and `global_batch_size`);
            ignored inside, where the split plan decides. Default None.

    Returns:
        A `ReplicaContext`.

    Example:

    ```python
    import keras_mirror

    ctx = keras_mirror.replica_context()
    print(ctx.num_replicas, ctx.share)  # 1 1.0 outside MirroredModel
    ```
    """
    active = getattr(_LOCAL, "context", None)
    if active is not None:
        return active
    return ReplicaContext(0, 1, batch_size, batch_size, offset=0)


def active():
    """The context of the running `MirroredModel` replica step, or None."""
    return getattr(_LOCAL, "context", None)


@contextlib.contextmanager
def activate(context):
    """Makes `context` current in this (replica) thread."""
    previous = getattr(_LOCAL, "context", None)
    _LOCAL.context = context
    try:
        yield context
    finally:
        _LOCAL.context = previous
