"""Plain BatchNormalization normalised by the global batch.

On one device, `BatchNormalization` normalises by the moments of the whole
batch. Split across replicas, Keras's plain layer normalises each shard by
its own moments and keeps replica 0's moving statistics: not one device's
model. With `batchnorm="global"` (the default) every moment over the batch
axis taken inside a replica step is the global batch's (sums and counts
all-reduced, a stand-in row left out, `two_pass_moments`), so every
replica normalises by, and keeps moving statistics of, the real rows of
the whole global batch.
`batchnorm="per_replica"` keeps each shard's own moments (Keras's plain
behaviour under `tf.distribute`).

Moments over other axes (`LayerNormalization`, `GroupNormalization`) are
per row and stay local.
"""

import collections
import contextlib
import logging

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import summed
from keras_mirror.steps import _stand_in

BATCHNORM_MODES = ("global", "per_replica")
FORWARD_COLLECTIVES = (
    "the model's BatchNormalization normalises by the global batch's "
    "statistics (synchronized, or `batchnorm='global'`), an all-reduce "
    "inside the forward pass")


def reduces_batch_axis(x, axes):
    """Whether `axes` of `x` include the batch axis (axis 0)."""
    rank = x.shape.rank
    if rank is None:
        return False
    return 0 in [int(a) % rank for a in tf.nest.flatten(axes)]


def two_pass_moments(x, axes, keepdims):
    """The global batch's mean, then its variance about that mean.

    One device's arithmetic (`tf.nn.moments`: the mean, then the mean of
    squared differences), not Keras's synchronized one (the mean of squares
    minus the squared mean), which loses digits on a few rows of large
    values. A stand-in row's terms are multiplied by 0 (all of a stand-in
    replica's, and a padded shard's extra rows: `_stand_in.row_keep`).
    """
    keep = _stand_in.row_keep(x)
    if keep is None:
        keep = tf.constant(1.0, x.dtype)

    def total(t):
        return summed(tf.reduce_sum(t * keep, axis=axes, keepdims=True))

    count = total(tf.ones_like(x))
    mean = tf.math.divide_no_nan(total(x), count)
    variance = tf.math.divide_no_nan(
        total(tf.math.squared_difference(x, tf.stop_gradient(mean))),
        count)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _global(original):
    """`_compute_moments` made global over the batch axis in a replica."""

    def moments(x, axes, keepdims):
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is None or replica_ctx.num_replicas_in_sync == 1 or \
                not reduces_batch_axis(x, axes):
            return original(x, axes, keepdims)
        return two_pass_moments(x, axes, keepdims)

    return moments


@contextlib.contextmanager
def global_moments():
    """Within the block, plain BatchNorm's moments are the global batch's
    (`batchnorm="global"`, entered only where the model has plain
    BatchNorm: `kinds`)."""
    module = _compat.moments_module()
    original = getattr(module, _compat.LOCAL_MOMENTS)
    with _compat.replaced(module, {
            _compat.LOCAL_MOMENTS: _global(original)},
            reason="plain BatchNorm's moments are the global batch's, as on "
            "one device"):
        yield


# What a model's BatchNormalization layers need in a replica step, decided
# once per compile (`kinds`): `synchronized`, a synchronized layer (its
# statistics leave a stand-in row out); `global_plain`, a plain layer with
# `batchnorm="global"` (its moments made the global batch's);
# `forward_collectives`, either (an all-reduce in the forward pass).
Kinds = collections.namedtuple(
    "Kinds", ["synchronized", "global_plain", "forward_collectives"])


def kinds(mirrored):
    """The model's BatchNorm `Kinds`, kept in the wrapper's `StepState`
    until the next compile."""
    state = mirrored._step_state
    if state.batchnorm is None:
        layers = batchnorm_layers(mirrored._inner)
        synced = any(layer.synchronized for layer in layers)
        plain = getattr(mirrored, "_batchnorm", "global") == "global" and \
            any(not layer.synchronized for layer in layers)
        state.batchnorm = Kinds(synced, plain, synced or plain)
    return state.batchnorm


def batchnorm_layers(model):
    """The model's `BatchNormalization` layers, nested ones included."""
    from keras_mirror.wrapper import _rebuild

    return [layer for layer in _rebuild.all_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def needs_forward_collectives(model, batchnorm):
    """Whether the forward pass all-reduces (so no one-trace step).

    True for a synchronized BatchNormalization, and for any plain one with
    `batchnorm="global"`.
    """
    for layer in batchnorm_layers(model):
        if layer.synchronized or batchnorm == "global":
            return True
    return False


def say_mode(model, batchnorm, num_replicas):
    """Says once, when wrapping, how the model's BatchNorm layers normalise.
    """
    plain = [layer.name for layer in batchnorm_layers(model)
             if not layer.synchronized]
    if not plain or num_replicas < 2:
        return
    if batchnorm == "global":
        what = ("by the global batch's statistics, as one device does (an "
                "all-reduce per layer in the forward pass); "
                "`batchnorm='per_replica'` keeps each shard's own")
    else:
        what = ("by each replica's shard statistics (`batchnorm="
                "'per_replica'`): not one device's training")
    level = logging.INFO if batchnorm == "global" else logging.WARNING
    logging.getLogger("keras_mirror").log(
        level, "keras-mirror normalises the BatchNormalization layers %s %s.",
        plain, what)
