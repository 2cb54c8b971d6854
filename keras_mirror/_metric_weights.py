"""Metric updates made inside a replica, weighted as one device's.

Inside a replica step a metric sees the replica's shard, not the global
batch; its variables are the model's single copy, which every replica
updates (`assign_add`), so a metric that sums over rows (accuracy, a mean
of per-example values, Keras's loss tracker given the batch's rows) adds up
to one device's state. Two kinds of update would not:

- Keras's compiled loss updates one `Mean` per output with the batch's
  static row count as its weight, which a shard of dynamic size lacks (every
  shard would weigh 1). Inside a replica it weighs the shard's rows, `b_r`,
  as one device weighs `B`.
- A `Mean` updated with one scalar and no weight (a GAN's
  `self.d_loss_tracker.update_state(d_loss)`) counts 1 per step on one
  device. Inside a replica it weighs the replica's share `b_r / B`, so the
  replicas' updates add up to the global batch's value with weight 1.
"""

import contextlib

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active


def _scalar(value):
    shape = getattr(value, "shape", ())
    return shape is not None and len(shape) == 0


def _weighted(original, by_rows):
    def update_state(*args, sample_weight=None, **kwargs):
        ctx = active()
        if (ctx is not None and ctx.distributed and sample_weight is None
                and len(args) == 1 and not kwargs and _scalar(
                    tf.convert_to_tensor(args[0]))):
            weight = ctx.shard_size if by_rows else ctx.share
            sample_weight = tf.cast(weight, tf.float32)
        return original(*args, sample_weight=sample_weight, **kwargs)

    return update_state


@contextlib.contextmanager
def replica_weights(model):
    """Within the block, `model`'s mean metrics weigh replica updates."""
    rows = _compat.output_loss_trackers(model)
    metrics = list(rows)
    for metric in getattr(model, "metrics", []) or []:
        if isinstance(metric, keras.metrics.Mean) and not any(
                metric is m for m in metrics):
            metrics.append(metric)
    patched = []
    try:
        for metric in metrics:
            by_rows = any(metric is m for m in rows)
            metric.update_state = _weighted(metric.update_state, by_rows)
            patched.append(metric)
        yield
    finally:
        for metric in patched:
            metric.__dict__.pop("update_state", None)
