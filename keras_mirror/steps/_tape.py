"""Per-row gradient targets in a model's own step, weighted as batch sums.

A model's own `train_step` may differentiate a loss that is not a scalar:
keras.io's DDIM computes `loss = self.loss(noises, pred_noises)` with
`loss=keras.losses.mean_absolute_error`, one value per pixel, and calls
`tape.gradient(loss, weights)`, which differentiates the *sum* of the
target. On one device that is a sum over the global batch; the optimizer
hooks of `own_step` weight each replica's gradient by its share `b_r / B`,
right for a batch mean, `N` times too small (on even shards) for a sum.

While the replicas' own steps are traced, `tf.GradientTape.gradient` scales
the output gradient of such a target by `B / b_r` (0 on an empty shard):
the share weighting then gives exactly the sum's gradient. A target counts
as per-row when its leading dimension is unknown until the step runs (the
replicas' shards have a dynamic row count; a dimension fixed in the graph
is not the batch's) and equals the shard's rows. Only gradients with
respect to variables are scaled: a gradient with respect to a tensor (a
WGAN-GP gradient penalty's `gradient(pred, [interpolated])`) is per row and
the same as one device's.

Each call also says which of the two it is (`replica_context.
differentiating`): the backward pass of a cross-replica sum or gather in
the step (BatchNorm's statistics, `all_gather`) weights the replicas' parts
by their shares for a gradient with respect to variables, and sums them as
one device would for one with respect to tensors only.
"""

import warnings

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active
from keras_mirror.replica_context import differentiating


def _is_variable(source):
    return isinstance(source, (tf.Variable, keras.Variable))


def _factor(target, ctx):
    """`B / b_r` for a per-row `target`, else None."""
    shape = target.shape
    if shape.rank is None or shape.rank == 0 or shape[0] is not None:
        return None
    rows = tf.cast(ctx.shard_size, tf.int32)
    per_row = tf.equal(tf.shape(target)[0], rows)
    scale = tf.math.divide_no_nan(tf.ones((), target.dtype),
                                  ctx.share_in(target.dtype))
    return tf.where(per_row, scale, tf.ones((), target.dtype))


def _scaled(target, output_gradients, ctx):
    """`output_gradients` with each per-row target's scaled, or None."""
    targets = tf.nest.flatten(target)
    given = (tf.nest.flatten(output_gradients)
             if output_gradients is not None else [None] * len(targets))
    out, changed = [], False
    for t, g in zip(targets, given):
        factor = _factor(tf.convert_to_tensor(t), ctx) if tf.is_tensor(
            t) else None
        if factor is None:
            out.append(g)
            continue
        changed = True
        out.append((tf.ones_like(t) if g is None else g) * factor)
    return out if changed else None


def _patched(original):
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        ctx = active()
        if ctx is None or not ctx.distributed:
            return original(self, target, sources,
                            output_gradients=output_gradients,
                            unconnected_gradients=unconnected_gradients)
        output_gradients = _for_variables(target, sources, output_gradients,
                                          ctx)
        variables = any(_is_variable(s) for s in tf.nest.flatten(sources))
        with differentiating(variables):
            return original(self, target, sources,
                            output_gradients=output_gradients,
                            unconnected_gradients=unconnected_gradients)

    return gradient


def _for_variables(target, sources, output_gradients, ctx):
    leaves = tf.nest.flatten(sources)
    variables = [s for s in leaves if _is_variable(s)]
    scaled = _scaled(target, output_gradients, ctx) if variables else None
    if scaled is None:
        return output_gradients
    if len(variables) < len(leaves):
        warnings.warn(
            "A model's own `train_step` calls `tape.gradient` of a per-row "
            "(not scalar) target with respect to variables and tensors at "
            "once: keras-mirror weights the variables' gradients as a batch "
            "sum, which makes the tensors' gradients differ from one "
            "device's. Call `tape.gradient` once for each. Received: "
            f"sources with {len(variables)} variables and "
            f"{len(leaves) - len(variables)} tensors",
            UserWarning, stacklevel=3)
    return scaled


_REASON = ("a per-row target of an own step's `tape.gradient` "
           "differentiates as the batch sum it is on one device; the call "
           "says whether it is with respect to variables or tensors")


def per_row_targets():
    """Within the block, replicas' per-row targets differentiate as sums.

    Entered once around the replicas' trace (`strategy.run`, which traces
    each replica in a thread of its own); the replacement acts only in a
    thread whose replica context is active, any other thread (a plain
    Keras model training beside it) gets TensorFlow's own `gradient`.
    Left, `tf.GradientTape.gradient` is the very function it was.
    """
    return _compat.replaced(
        tf.GradientTape, {"gradient": _patched(tf.GradientTape.gradient)},
        _REASON, label="tf.GradientTape")
