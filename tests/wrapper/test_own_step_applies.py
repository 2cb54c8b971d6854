"""An own step's optimizers are built on what the step applies them to."""

import keras
import numpy as np
import tensorflow as tf
from support.helpers import max_diff

import keras_mirror


class GAN(keras.Model):
    """keras.io's GAN step: two optimizers, each on one sub-model."""

    def __init__(self):
        super().__init__()
        self.latent = 3
        self.generator = keras.Sequential([
            keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(4)])
        self.discriminator = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
            keras.layers.Dense(1)])

    def call(self, x):
        return self.discriminator(x)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        real = data[0] if isinstance(data, tuple) else data
        batch = tf.shape(real)[0]
        z = keras.random.normal((batch, self.latent), seed=1)
        fake = self.generator(z)
        both = tf.concat([fake, real], 0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(both))
        weights = self.discriminator.trainable_weights
        self.d_optimizer.apply_gradients(
            zip(tape.gradient(d_loss, weights), weights))
        z = keras.random.normal((batch, self.latent), seed=2)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)),
                                  self.discriminator(self.generator(z)))
        weights = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(
            zip(tape.gradient(g_loss, weights), weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def _gan():
    keras.utils.set_random_seed(0)
    gan = GAN()
    gan.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(2e-3))
    return gan


def _slots(optimizer):
    """(kind, shape) of each variable: names differ by Keras's counters."""
    return [(v.name.rsplit("_", 1)[-1], tuple(v.shape))
            for v in optimizer.variables]


def test_each_optimizer_holds_what_one_device_builds(cpus):
    x = np.random.default_rng(0).normal(size=(30, 4)).astype("float32")
    single = _gan()
    single.fit(x, batch_size=7, epochs=1, shuffle=False, verbose=0)
    gan = _gan()
    mirrored = keras_mirror.MirroredModel(gan, devices=cpus)
    mirrored.fit(x, batch_size=7, epochs=1, shuffle=False, verbose=0)
    for name in ("d_optimizer", "g_optimizer"):
        expected = getattr(single, name)
        optimizer = getattr(gan, name)
        assert len(optimizer.variables) == len(expected.variables)
        assert _slots(optimizer) == _slots(expected)
        assert max_diff([v.numpy() for v in expected.variables],
                        [v.numpy() for v in optimizer.variables]) < 1e-5
    assert len(gan.d_optimizer.variables) == 2 + 2 * 4  # 2 Dense layers
    assert max_diff(single.get_weights(), gan.get_weights()) < 1e-5
