"""The probe's pass writes nothing and repeats its draws (issue 38).

Tests of `keras_mirror/steps/_loss_terms.py`: the loss terms of a batch
and of it repeated twice, computed as `fit` computes them (training=True)
in a pruned graph.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror.steps import _loss_terms

pytestmark = pytest.mark.usefixtures("cpus")


class _Counting(keras.Model):
    """BatchNorm, Dropout, an activity regulariser and a metric updated in
    `compute_loss`, which asserts `training` as Keras's own test does."""

    def __init__(self):
        super().__init__(name="counting")
        self.custom = keras.metrics.Mean(name="custom")
        self.dense = keras.layers.Dense(4, activity_regularizer="l2")
        self.norm = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.5, seed=3)
        self.out = keras.layers.Dense(2)

    def call(self, x, training=None):
        h = self.norm(self.dense(x), training=training)
        return self.out(self.drop(h, training=training))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        assert training
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom.update_state(loss * 4)
        return loss


def _batch(rows=6):
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(rows, 3)).astype("float32")),
            tf.constant(rng.normal(size=(rows, 2)).astype("float32")), None)


def _state(model):
    return [np.array(v.numpy()) for v in model.variables + model.metrics[0]
            .variables + model.custom.variables]


def test_the_pass_writes_no_variable_metric_or_seed_state():
    keras.utils.set_random_seed(0)
    model = _Counting()
    model.compile(optimizer="sgd", loss="mse")
    x, y, _ = _batch()
    model.train_on_batch(x, y)
    before = _state(model)
    _loss_terms.evaluate(model, (x, y, None))
    after = _state(model)
    assert len(before) == len(after) > 8
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


class _SumOfDropped(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_pred - y_true))


def test_the_doubled_batch_draws_the_batch_s_numbers_twice():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8),
                              keras.layers.Dropout(0.5, seed=1),
                              keras.layers.GaussianNoise(0.3, seed=2),
                              keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=_SumOfDropped())
    model.train_on_batch(*_batch()[:2])  # the compiled loss built
    once, twice = _loss_terms.evaluate(model, _batch())
    value, grad = once.outputs[0]
    np.testing.assert_allclose(twice.outputs[0][0], 2 * value, rtol=1e-6)
    np.testing.assert_allclose(twice.outputs[0][1], 2 * grad, rtol=1e-5,
                               atol=1e-6)
    assert np.linalg.norm(grad) > 0


class _RowDraws(keras.layers.Layer):
    """Draws for `k` rows an example: a Reshape of the batch (example-major,
    a constant shape in the probe's static graph), and stacked blocks of
    it (`concatenate([h, -h])`) for Dropout."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        rows = keras.ops.reshape(x, (-1, 2))              # (b * 4, 2)
        rows = rows + keras.random.normal(tf.shape(rows), seed=self.seed)
        h = keras.ops.reshape(rows, (-1, 8))
        both = keras.random.dropout(keras.ops.concatenate([h, -h]), 0.5,
                                    seed=self.seed)
        b = keras.ops.shape(h)[0]
        return both[:b] - both[b:]


def test_draws_of_several_rows_an_example_repeat_in_their_order():
    """Example-major rows repeat their halves, stacked blocks each block:
    the doubled batch's sum is twice the batch's (a fresh draw was not)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8),
                              _RowDraws(), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=_SumOfDropped())
    model.train_on_batch(*_batch()[:2])
    once, twice = _loss_terms.evaluate(model, _batch())
    value, grad = once.outputs[0]
    np.testing.assert_allclose(twice.outputs[0][0], 2 * value, rtol=1e-6)
    np.testing.assert_allclose(twice.outputs[0][1], 2 * grad, rtol=1e-5,
                               atol=1e-6)
