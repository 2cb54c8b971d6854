"""One trace for N replicas (`keras_mirror/steps/_one_trace.py`; its state
in `keras_mirror/steps/_state.py`): traced once, exact.

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
from keras_mirror.replica_context import CROSS_REPLICA_IN_ONE_TRACE
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
    traced = mirrored._step_state.one_trace_last
    # Every replica of every step called the same trace.
    assert traced.function.experimental_get_tracing_count() == 1
    assert mirrored._step_state.one_trace_off is None
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
    assert mirrored._step_state.one_trace_off == CROSS_REPLICA_IN_ONE_TRACE
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(one_device, weights))
    assert diff < TOL


class Gathers(layers.Layer):
    """A forward pass that reads the global batch (`all_gather`)."""

    def call(self, x):
        rows = keras_mirror.replica_context().all_gather(x)
        return x + 0.0 * tf.reduce_mean(rows)


def test_a_gather_in_the_forward_pass_is_noted_and_logged_once(
        one_device, caplog):
    def build():
        return keras.Sequential([keras.Input((6,)), Gathers(), _model()])

    with caplog.at_level("INFO", logger="keras_mirror"):
        mirrored, weights = _train("strategy", build)
    assert mirrored._step_state.one_trace_off == CROSS_REPLICA_IN_ONE_TRACE
    said = [r.getMessage() for r in caplog.records
            if "traces the replica step per replica" in r.getMessage()]
    assert said == [
        "keras-mirror traces the replica step per replica, not once for all "
        f"replicas, because {CROSS_REPLICA_IN_ONE_TRACE}."]
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(one_device, weights))
    assert diff < TOL


def test_a_masked_output_is_noted_while_tracing():
    def build():
        return keras.Sequential([
            keras.Input((4,)), layers.Embedding(5, 3, mask_zero=True),
            layers.Dense(3)])

    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, size=(11, 4))
    y = rng.normal(size=(11, 4, 3)).astype("float32")
    weights = []
    for wrap in (False, True):
        keras.utils.set_random_seed(7)
        model = build()
        model.compile(optimizer="adam", loss="mse")
        target = keras_mirror.MirroredModel(model) if wrap else model
        target.fit(batches(x, y, SIZES), epochs=2, verbose=0)
        weights.append([w.numpy() for w in model.weights])
    assert target._step_state.one_trace_off == _one_trace._xla.MASKED
    diff = max(float(np.abs(a - b).max()) for a, b in zip(*weights))
    assert diff < TOL


def test_a_note_outside_the_single_trace_is_a_bug_not_a_fallback():
    with pytest.raises(RuntimeError, match="outside the single trace"):
        _one_trace.note("a reason")


def test_the_step_keeps_its_state_in_one_object():
    mirrored, _ = _train("strategy")
    step_keys = [k for k in vars(mirrored) if k.startswith(
        ("_one_", "_xla", "_warned", "_scanned"))]
    assert step_keys == []
    update = mirrored._step_state.one_update_last
    assert update.function.experimental_get_tracing_count() == 1
