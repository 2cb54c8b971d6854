"""Silent differences inside a model's own step (issue 24, section 3).

- keras.io's DDIM differentiates a per-pixel loss (`loss=
  keras.losses.mean_absolute_error`, `tape.gradient(loss, weights)` sums
  it): a batch sum, weighted exactly as one (`steps/_tape.py`).
- It fits a dataset of images only, its own `train_step` making the
  targets: no "must yield (inputs, targets)" refusal.

Models with their own `train_step` run on the `"strategy"` path.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import max_diff

import keras_mirror


class TinyDiffusion(keras.Model):
    """keras.io DDIM's training step, on 4x4 single-channel images."""

    def __init__(self, per_pixel=True, **kwargs):
        super().__init__(**kwargs)
        self.network = keras.Sequential([
            keras.Input((4, 4, 1)),
            keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(1, 3, padding="same")])
        self.noise_loss_tracker = keras.metrics.Mean(name="n_loss")
        self.seed_generator = keras.random.SeedGenerator(3)
        self.per_pixel = per_pixel

    @property
    def metrics(self):
        return [self.noise_loss_tracker]

    def train_step(self, images):
        rows = tf.shape(images)[0]
        noises = keras.random.normal(shape=(rows, 4, 4, 1),
                                     seed=self.seed_generator)
        times = keras.random.uniform(shape=(rows, 1, 1, 1),
                                     seed=self.seed_generator)
        noisy = tf.sqrt(1.0 - times) * images + tf.sqrt(times) * noises
        with tf.GradientTape() as tape:
            pred_noises = self.network(noisy, training=True)
            noise_loss = self.loss(noises, pred_noises)  # one per pixel
            target = noise_loss if self.per_pixel else tf.reduce_mean(
                noise_loss)
        gradients = tape.gradient(target, self.network.trainable_weights)
        self.optimizer.apply_gradients(
            zip(gradients, self.network.trainable_weights))
        self.noise_loss_tracker.update_state(noise_loss)
        return {m.name: m.result() for m in self.metrics}


def _diffusion(per_pixel=True):
    keras.utils.set_random_seed(0)
    model = TinyDiffusion(per_pixel)
    model.network.build((None, 4, 4, 1))
    model.built = True
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.mean_absolute_error)
    return model


def _images():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(50, 4, 4, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices(images).batch(14)


@pytest.mark.parametrize("per_pixel", [True, False])
def test_a_per_pixel_gradient_target_equals_one_device(cpus, per_pixel):
    single = _diffusion(per_pixel)
    keras.utils.set_random_seed(5)
    expected = single.fit(_images(), epochs=2, verbose=0).history
    wrapped = _diffusion(per_pixel)
    mirrored = keras_mirror.MirroredModel(wrapped, devices=cpus)
    assert mirrored.execution == "strategy"
    keras.utils.set_random_seed(5)
    logs = mirrored.fit(_images(), epochs=2, verbose=0).history
    assert max_diff(single.get_weights(), wrapped.get_weights()) < 1e-5
    np.testing.assert_allclose(logs["n_loss"], expected["n_loss"],
                               rtol=1e-5)


def test_a_dataset_of_inputs_only_is_for_the_own_step_to_use(cpus):
    """Compiled with a loss, fitted on images only: its own `train_step`
    makes the targets, as on one device."""
    mirrored = keras_mirror.MirroredModel(_diffusion(), devices=cpus)
    history = mirrored.fit(_images(), epochs=1, verbose=0)
    assert np.isfinite(history.history["n_loss"][0])


def test_a_gradient_with_respect_to_inputs_is_left_per_row(cpus):
    """A gradient penalty's `tape.gradient(pred, [inputs])` is one row's
    gradient per row, on one device as on a replica: not scaled."""

    class Penalty(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    pred = self(x, training=True)
                slopes = inner.gradient(pred, [x])[0]
                norms = tf.sqrt(tf.reduce_sum(tf.square(slopes), axis=1))
                loss = tf.reduce_mean(tf.square(pred - y)) + tf.reduce_mean(
                    tf.square(norms - 1.0))
            grads = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads,
                                               self.trainable_weights))
            return {"loss": loss}

    def make():
        keras.utils.set_random_seed(0)
        model = Penalty()
        model(np.zeros((1, 3), "float32"))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 3)).astype("float32")
    y = rng.normal(size=(30, 1)).astype("float32")
    single = make()
    single.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
    wrapped = make()
    keras_mirror.MirroredModel(wrapped, devices=cpus).fit(
        x, y, batch_size=10, epochs=2, verbose=0, shuffle=False)
    assert max_diff(single.get_weights(), wrapped.get_weights()) < 1e-5
