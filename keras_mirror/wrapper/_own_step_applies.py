"""What a model's own `train_step` applies each optimizer to.

Keras builds an optimizer lazily, on the variables of its first
`apply_gradients`: a GAN's `d_optimizer` holds slots for the discriminator
only. keras-mirror builds every optimizer on one device before the first
replica step (nothing may be created inside a replica), so it must know
those variables up front. It traces the user's `train_step` once on the
first batch's spec, without running it, with each optimizer's `apply`
recording its variables instead of applying: the variables, in the order
the step passes them, as Keras's first `apply` would build on.
"""

import contextlib

import keras
import tensorflow as tf

from keras_mirror import _compat


def applied_variables(model, optimizers, batch):
    """{id(optimizer): its variables in the step's first `apply`}, for the
    optimizers the step applies; an optimizer it never applies is absent.
    """
    applied = {}
    spec = tf.nest.map_structure(
        lambda t: t if t is None else tf.TensorSpec(t.shape, t.dtype),
        _data(batch))
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(_recording(optimizer, applied))
        tf.function(model.train_step).get_concrete_function(spec)
    return applied


def _data(batch):
    """The `data` argument of `train_step`, packed as Keras packs it."""
    x, y, sample_weight = (tuple(batch) + (None, None))[:3]
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)


def _recording(optimizer, applied):
    """`optimizer.apply` records its variables and applies nothing (what
    stood in its place before, keras-mirror's own, comes back after)."""
    def apply(grads, trainable_variables=None):
        if trainable_variables is not None:
            applied.setdefault(id(optimizer), list(trainable_variables))
        return optimizer.iterations

    return _compat.replaced(
        optimizer, {"apply": apply}, label="keras.optimizers.Optimizer",
        reason="records the variables an own step applies each optimizer "
        "to, to build it on one device before the replicas run")
