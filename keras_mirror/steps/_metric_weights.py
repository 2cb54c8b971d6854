"""Metric updates made inside a replica, weighted as one device's.

Inside a replica step a metric sees the replica's shard, not the global
batch; its variables are the model's single copy, which every replica
updates (`assign_add`), so a metric that sums over rows (accuracy, a mean
of per-example values, Keras's loss tracker given the batch's rows) adds up
to one device's state. One kind of update would not: a `Mean`
updated with one scalar and no weight. Keras's compiled loss does this with
each output's loss (its weight is the batch's static row count, None for a
batch of unknown size), and so does a GAN's
`self.d_loss_tracker.update_state(d_loss)`: one device counts each step
once. Inside a replica such an update weighs the replica's share `b_r / B`,
so that the replicas' updates add up to the global batch's value with
weight 1; an empty shard adds nothing (its mean over no rows may be NaN).
"""

import contextlib

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active
from keras_mirror.steps import _stand_in
from keras_mirror.steps import arithmetic


def _scalar(value):
    shape = getattr(value, "shape", ())
    return shape is not None and len(shape) == 0


def _weighted(original, batch_sum=False):
    def update_state(*args, sample_weight=None, **kwargs):
        ctx = active()
        if (ctx is not None and ctx.distributed and sample_weight is None
                and len(args) == 1 and not kwargs and _scalar(
                    tf.convert_to_tensor(args[0]))):
            value = tf.convert_to_tensor(args[0])
            dtype = arithmetic.loss_dtype(value)
            sample_weight = ctx.share_in(dtype)
            # An empty shard adds nothing (its mean may be NaN).
            value = tf.cast(value, dtype)
            if batch_sum:  # the shards' sums add up to the batch's
                value = tf.math.divide_no_nan(value, sample_weight)
            args = (tf.where(sample_weight > 0, value,
                             tf.zeros_like(value)),)
        return original(*args, sample_weight=sample_weight, **kwargs)

    return update_state


class Produced:
    """The metric behind each tensor a metric's `result()` returned inside
    the replicas, in one step's trace: a step that returns
    `tracker.result()` under any key reports that metric, read once every
    replica has updated it. Owned by the block that records it
    (`replica_weights`), and dropped with it."""

    def __init__(self):
        self._made = []  # (tensor, metric, key or None)

    def add(self, out, metric):
        if isinstance(out, dict):
            self._made.extend((leaf, metric, key) for key, leaf in
                              out.items())
        else:
            self._made.append((out, metric, None))

    def source(self, value):
        """`(metric, key or None)` whose `result()` gave `value`, else
        None."""
        for made, metric, key in self._made:
            if made is value:
                return metric, key
        return None


def _recording(original, metric, produced):
    def result():
        out = original()
        produced.add(out, metric)
        return out

    return result


def read(metric, key):
    """`metric.result()` (its entry `key` for a dict result), as float32."""
    out = metric.result()
    if key is not None:
        out = out[key]
    return tf.cast(out, tf.float32)


def updated_in_replicas(model, own_step):
    """The metrics a replica step may update: all of them in a model's own
    `train_step`; in the built-in step all but the loss tracker and the
    compiled metrics, which it updates once, outside the replicas, on the
    gathered outputs (`strategy.ReplicaSteps._track`)."""
    metrics = [m for m in getattr(model, "metrics", []) or []
               if isinstance(m, keras.metrics.Metric)]
    if own_step:
        return metrics
    outside = (_compat.loss_tracker(model),
               _compat.compile_metrics(model))
    return [m for m in metrics if not any(m is o for o in outside)]


_WEIGHTS = ("a mean updated with one scalar weighs the replica's share; a "
            "stand-in replica updates nothing")
_RESULTS = ("a step returning `tracker.result()` reports the metric once "
            "every replica updated it")


@contextlib.contextmanager
def replica_weights(model, sums=(), own_step=False):
    """Within the block, the metrics updated in a replica weigh it as one
    device would (`updated_in_replicas`; none: nothing is replaced).

    `sums`: the per-output loss trackers whose values are batch sums (a
    loss with `reduction="sum"`): the replicas' values add up, so each
    update weighs its value divided by the share. No metric is updated on
    a stand-in replica (`_stand_in`). In a model's own step every metric's
    `result()` is also recorded in the `Produced` the block yields.
    """
    produced = Produced()
    metrics = updated_in_replicas(model, own_step)
    weighted = _compat.output_loss_trackers(model) + [
        m for m in metrics if isinstance(m, keras.metrics.Mean)]
    with contextlib.ExitStack() as stack:
        for metric in metrics:
            update = metric.update_state
            if any(metric is m for m in weighted):
                update = _weighted(update, any(metric is m for m in sums))
            # A stand-in replica (an empty shard running one row) updates
            # no metric: its row is not data.
            stack.enter_context(_compat.replaced(
                metric, {"update_state": _stand_in.unless_stand_in(update)},
                label="keras.metrics.Metric", reason=_WEIGHTS))
            if own_step:
                stack.enter_context(_compat.replaced(
                    metric, {"result": _recording(metric.result, metric,
                                                  produced)},
                    label="keras.metrics.Metric", reason=_RESULTS))
        yield produced
