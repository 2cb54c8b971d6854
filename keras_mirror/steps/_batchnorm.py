"""BatchNormalization's statistics in a replica step: the global batch's.

On one device, `BatchNormalization` normalises by the moments of the whole
batch. Split across replicas, Keras's plain layer normalises each shard by
its own moments and keeps replica 0's moving statistics: not one device's
model. With `batchnorm="global"` (the default) every moment over the batch
axis taken inside a replica step is the global batch's (sums and counts
all-reduced, a stand-in row left out, `global_moments`), so every
replica normalises by, and keeps moving statistics of, the real rows of
the whole global batch.
`batchnorm="per_replica"` keeps each shard's own moments (Keras's plain
behaviour under `tf.distribute`).

A synchronized layer (`synchronized=True`) all-reduces its sums in Keras
already; in a replica step the same sums leave the stand-in rows out, with
Keras's own arithmetic. Both are one replacement, `global_statistics`.

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


def _keep(x, axes):
    """1 on the rows that count, 0 on stand-in rows: row by row where the
    moments reduce the batch axis (`_stand_in.row_keep`), else the replica
    as a whole (0 on a stand-in replica)."""
    if reduces_batch_axis(x, axes):
        keep = _stand_in.row_keep(x)
    else:
        stand_in = _stand_in.is_stand_in()
        keep = None if stand_in is None else tf.cast(
            tf.logical_not(stand_in), x.dtype)
    return tf.constant(1.0, x.dtype) if keep is None else keep


def global_moments(x, axes, keepdims, two_pass):
    """The global batch's moments, stand-in rows left out.

    Sums and counts are all-reduced (`summed`), each stand-in row's terms
    multiplied by 0. `two_pass`: one device's arithmetic for a plain layer
    (`tf.nn.moments`: the mean, then the mean of squared differences);
    else Keras's synchronized arithmetic (the mean of squares minus the
    squared mean, `keras.src.backend.tensorflow.nn._compute_moments_sync`),
    which a synchronized layer computes on one device too.
    """
    keep = _keep(x, axes)

    def total(t):
        return summed(tf.reduce_sum(t * keep, axis=axes, keepdims=True))

    count = total(tf.ones_like(x))
    mean = tf.math.divide_no_nan(total(x), count)
    if two_pass:
        variance = tf.math.divide_no_nan(
            total(tf.math.squared_difference(x, tf.stop_gradient(mean))),
            count)
    else:
        variance = tf.maximum(
            tf.math.divide_no_nan(total(tf.square(x)), count)
            - tf.square(mean), 0.0)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _replacement(original, two_pass):
    """Keras's moments function `original`, global inside a replica step:
    a plain layer's (`two_pass`) where it reduces the batch axis, a
    synchronized layer's where the step knows its stand-in rows."""

    def moments(x, axes, keepdims):
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is None or replica_ctx.num_replicas_in_sync == 1:
            return original(x, axes, keepdims)
        if two_pass and not reduces_batch_axis(x, axes):
            return original(x, axes, keepdims)
        if not two_pass and _stand_in.is_stand_in() is None:
            return original(x, axes, keepdims)
        return global_moments(x, axes, keepdims, two_pass)

    return moments


@contextlib.contextmanager
def global_statistics(kinds):
    """Within the block, BatchNorm's moments are the global batch's, real
    rows only: a synchronized layer's (`kinds.synchronized`) and, with
    `batchnorm="global"`, a plain layer's (`kinds.global_plain`)."""
    module = _compat.moments_module()
    replacements = {}
    if kinds.synchronized:
        replacements[_compat.SYNC_MOMENTS] = _replacement(
            getattr(module, _compat.SYNC_MOMENTS), two_pass=False)
    if kinds.global_plain:
        replacements[_compat.LOCAL_MOMENTS] = _replacement(
            getattr(module, _compat.LOCAL_MOMENTS), two_pass=True)
    with _compat.replaced(
            module, replacements,
            reason="BatchNorm's moments are the global batch's, as on one "
            "device, and leave a stand-in row out"):
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
    return [layer for layer in _compat.layers_within(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


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
