"""One trace for N replicas (`steps/_one_trace.py`): traced once, exact.

Keras's built-in step traces a replica's forward pass, loss and gradients
once and every replica calls that trace, on both execution paths, with
uneven and empty shards (global batches of 5, 1, 2, 3 rows over 4
replicas) and random draws (Dropout): the weights equal one device's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from support.helpers import batches

import keras_mirror
from keras_mirror.steps import _one_trace

TOL = 1e-5
SIZES = (5, 1, 2, 3)


def _model():
    return keras.Sequential([
        keras.Input((6,)),
        layers.Dense(16, activation="relu", kernel_regularizer="l2"),
        layers.Dropout(0.3, seed=3), layers.Dense(3)])


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(sum(SIZES), 6)).astype("float32")
    y = rng.normal(size=(sum(SIZES), 3)).astype("float32")
    return batches(x, y, SIZES)


def _train(execution=None, build=_model):
    keras.utils.set_random_seed(7)
    model = build()
    model.compile(optimizer="adam", loss="mse")
    target = model if execution is None else keras_mirror.MirroredModel(
        model, execution=execution)
    target.fit(_data(), epochs=2, verbose=0)
    return target, [w.numpy() for w in model.weights]


@pytest.fixture(scope="module")
def one_device():
    return _train()[1]


@pytest.mark.parametrize("execution", ["strategy"])
def test_one_trace_serves_every_replica(execution, one_device):
    mirrored, weights = _train(execution)
    assert len(mirrored.devices) == 4
    traced = mirrored._one_trace_last
    # Every replica of every step called the same trace.
    assert traced.tracing_count() == 1
    assert "_one_trace_off" not in mirrored.__dict__
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(one_device, weights))
    assert diff < TOL


class Reduces(layers.Layer):
    """A forward pass that all-reduces across replicas."""

    def call(self, x):
        return x + 0.0 * keras_mirror.replica_context().all_reduce_sum(
            tf.reduce_sum(x))


def test_a_reduction_in_the_forward_pass_traces_per_replica(one_device):
    def build():
        model = _model()
        return keras.Sequential([keras.Input((6,)), Reduces(), model])

    mirrored, weights = _train("strategy", build)
    # TensorFlow refuses `merge_call` inside a function traced once.
    assert mirrored._one_trace_off == _one_trace.REDUCES
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(one_device, weights))
    assert diff < TOL
