"""An own `train_step`'s optimizers train as on one device, whatever the
step does between the loss and `apply`: the Keras guide's loss-scaling
step with a `LossScaleOptimizer`, `scale_loss` on a plain optimizer,
gradient accumulation (alone and inside a `LossScaleOptimizer`), clipping,
weight decay with EMA, and a GAN's two optimizers.

Each test trains the same model with plain Keras on one device and through
`MirroredModel` on 4 replicas, 18 rows in batches of 8, 8 and 2 (the last
leaves two shards empty), for 2 epochs, and compares the weights and every
optimizer variable (slots, accumulators, the loss scale, the counters).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror

ROWS, BATCH, EPOCHS = 18, 8, 2  # batches of 8, 8, 2 rows: shards 1, 1, 0, 0


class GuideStep(keras.Model):
    """The Keras guide's `train_step` ("Customizing what happens in `fit()`"),
    with the mixed-precision guide's loss scaling."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled_loss = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def guide_model(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = GuideStep(inputs, keras.layers.Dense(3)(hidden))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def data(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 6)).astype(keras.config.floatx())
    y = rng.normal(size=(ROWS, 3)).astype(keras.config.floatx())
    return x, y


def differences(reference, mirrored):
    """Max absolute difference of the weights and of the optimizers'
    variables, in order; the counters must be equal."""
    weights = max(float(np.max(np.abs(a - b))) for a, b in zip(
        reference.get_weights(), mirrored.get_weights()))
    slots = 0.0
    for ref_opt, opt in zip(optimizers(reference), optimizers(mirrored)):
        assert len(ref_opt.variables) == len(opt.variables)
        for a, b in zip(ref_opt.variables, opt.variables):
            assert a.shape == b.shape
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype.kind in "iu":
                assert a == b
            else:
                slots = max(slots, float(np.max(np.abs(a - b))))
    return weights, slots


def optimizers(model):
    if hasattr(model, "d_optimizer"):
        return [model.d_optimizer, model.g_optimizer]
    return [model.optimizer]


def fit_both(build, cpus, x, y, epochs=EPOCHS):
    """The model trained by plain Keras, and the same through the wrapper."""
    reference = build()
    reference.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                  verbose=0)
    model = build()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False,
                 verbose=0)
    assert tuple(mirrored.split_plan(ROWS % BATCH)) == (1, 1, 0, 0)
    return reference, model


OPTIMIZERS = {
    # The mixed-precision guide's optimizer (the loss scale is 2**15; in
    # float32 it changes no value, it only must not change the update).
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01)),
    "scale_loss_factor": lambda: keras.optimizers.Adam(
        0.01, loss_scale_factor=128.0),
    "accumulation": lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=2),
    "accumulation_loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)),
    # Thresholds below the gradients' norms: clipping is active.
    "clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.05),
    "clipnorm_accumulation": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, global_clipnorm=0.05,
        gradient_accumulation_steps=2),
    "weight_decay_ema": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_guide_step_trains_as_one_device(name, cpus):
    x, y = data()
    reference, model = fit_both(
        lambda: guide_model(OPTIMIZERS[name]()), cpus, x, y)
    weights, slots = differences(reference, model)
    print(f"{name}: weights {weights:.3g}, optimizer variables {slots:.3g}")
    assert weights < 1e-5
    assert slots < 1e-5


def test_accumulation_accumulates_the_global_gradient(cpus):
    """After an odd number of steps (3: the last with two empty shards)
    the accumulators hold one device's gradient of the last step."""
    x, y = data()
    reference, model = fit_both(
        lambda: guide_model(OPTIMIZERS["accumulation"]()), cpus, x, y,
        epochs=1)
    ref = [np.asarray(v) for v in reference.optimizer.variables
           if "accumulator" in v.path]
    got = [np.asarray(v) for v in model.optimizer.variables
           if "accumulator" in v.path]
    assert ref and len(ref) == len(got)
    assert any(np.any(r != 0) for r in ref)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got))
    print(f"accumulators: {diff:.3g}")
    assert diff < 1e-6


@pytest.mark.parametrize("name", ["clipnorm", "clipnorm_accumulation"])
def test_clipping_sees_the_global_gradient_in_float64(name, cpus):
    keras.config.set_floatx("float64")
    try:
        x, y = data()
        reference, model = fit_both(
            lambda: guide_model(OPTIMIZERS[name]()), cpus, x, y)
        weights, slots = differences(reference, model)
    finally:
        keras.config.set_floatx("float32")
    print(f"{name} float64: weights {weights:.3g}, slots {slots:.3g}")
    # The shares (1/4, 1/2) are exact: float64 arithmetic agrees.
    assert weights < 1e-12
    assert slots < 1e-12


class GAN(keras.Model):
    """keras.io's GAN step with two optimizers, the noise given as data;
    the discriminator's optimizer scales its loss."""

    def __init__(self, discriminator, generator, **kwargs):
        super().__init__(**kwargs)
        self.discriminator = discriminator
        self.generator = generator

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        real, noise = data
        rows = tf.shape(real)[0]
        labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], 0)
        with tf.GradientTape() as tape:
            pred = self.discriminator(
                tf.concat([self.generator(noise), real], 0))
            d_loss = self.loss_fn(labels, pred)
            scaled = self.d_optimizer.scale_loss(d_loss)
        d_vars = self.discriminator.trainable_weights
        self.d_optimizer.apply(tape.gradient(scaled, d_vars), d_vars)
        with tf.GradientTape() as tape:
            pred = self.discriminator(self.generator(noise))
            g_loss = self.loss_fn(tf.zeros((rows, 1)), pred)
        g_vars = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(
            zip(tape.gradient(g_loss, g_vars), g_vars))
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan():
    keras.utils.set_random_seed(3)
    discriminator = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1)])
    generator = keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(6)])
    model = GAN(discriminator, generator)
    model.compile(
        d_optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01, global_clipnorm=0.5)),
        g_optimizer=keras.optimizers.Adam(
            0.01, gradient_accumulation_steps=2))
    return model


def test_a_gan_with_two_optimizers_trains_as_one_device(cpus):
    real, _ = data()
    noise = np.random.default_rng(2).normal(size=(ROWS, 3)).astype("float32")
    reference, model = fit_both(gan, cpus, real, noise)
    weights, slots = differences(reference, model)
    print(f"GAN: weights {weights:.3g}, optimizer variables {slots:.3g}")
    assert weights < 1e-5
    assert slots < 1e-5
