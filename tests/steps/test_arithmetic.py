"""`on_nonfinite`: a NaN or Inf on one replica is caught in its step.

A global batch of 16 rows splits 4/4/4/4 over 4 replicas, so row 9 goes to
replica 2. A NaN placed in that row poisons replica 2's loss and gradients;
a zero in the `GradTrap` column gives a finite loss but a NaN gradient. Each
mode is checked for what it promises: `"raise"` raises `NonFiniteError`
naming the replica and step with weights and optimizer iterations
unchanged; `"skip_step"` skips the update on every replica, counts the bad
values in `replica_nonfinite` and warns; `"warn"` applies the update and
warns with the replica and step.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror
from keras_mirror import errors
from keras_mirror.steps import arithmetic

# Each test runs on both execution paths (conftest.py).
pytestmark = pytest.mark.usefixtures("execution")

ROWS = 16
BAD_ROW = 9  # balanced split 4/4/4/4: rows 8..11 go to replica 2
BAD_REPLICA = 2


@tf.custom_gradient
def _trap(w, x1):
    """Zero output; gradient `sum(dy * log|x1|)`: -Inf where `x1 = 0`."""

    def grad(dy):
        return tf.reduce_sum(dy * tf.math.log(tf.abs(x1))), tf.zeros_like(x1)

    return 0.0 * w * x1, grad


class GradTrap(keras.layers.Layer):
    """Finite (zero) output whose weight gradient is -Inf at `x1 = 0`."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return _trap(self.w, x[:, 1:2])


def _model():
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1)(inputs)
    outputs = keras.layers.Add()([dense, GradTrap()(inputs)])
    return keras.Model(inputs, outputs)


def _data(bad="nan"):
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (ROWS, 3)).astype("float32")
    y = rng.uniform(size=(ROWS, 1)).astype("float32")
    if bad == "nan":
        x[BAD_ROW, 2] = np.nan
    elif bad == "inf_target":
        y[BAD_ROW, 0] = np.inf
    elif bad == "gradient":
        x[BAD_ROW, 1] = 0.0
    return x, y


def _mirrored(cpus, mode):
    mirrored = keras_mirror.MirroredModel(_model(), devices=cpus,
                                          on_nonfinite=mode)
    mirrored.compile(optimizer="adam", loss="mse")
    return mirrored


def _state(mirrored):
    return ([w.numpy().copy() for w in mirrored.weights],
            int(mirrored.optimizer.iterations.numpy()))


def _same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b))


def _fit(mirrored, x, y, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = mirrored.fit(x, y, batch_size=ROWS, shuffle=False,
                               verbose=0, **kwargs)
    messages = [str(w.message) for w in caught
                if issubclass(w.category, RuntimeWarning)]
    return history, messages


@pytest.mark.parametrize("bad", ["nan", "inf_target", "gradient"])
def test_raise_names_replica_and_step_and_keeps_weights(cpus, bad):
    mirrored = _mirrored(cpus, "raise")
    x, y = _data(bad)
    before = _state(mirrored)
    with pytest.raises(errors.NonFiniteError,
                       match=r"step 1 on replica\(s\) \[2\]") as info:
        mirrored.fit(x, y, batch_size=ROWS, shuffle=False, verbose=0)
    assert "Received: on_nonfinite='raise'" in str(info.value)
    assert isinstance(info.value, FloatingPointError)
    weights, iterations = _state(mirrored)
    assert _same(weights, before[0])
    assert iterations == before[1] == 0


def test_raise_in_the_step_it_happens(cpus):
    """Clean steps before it apply; the bad third step raises and is undone."""
    mirrored = _mirrored(cpus, "raise")
    x, y = _data(None)
    bad_x, bad_y = _data("nan")
    x = np.concatenate([x, x, bad_x])
    y = np.concatenate([y, y, bad_y])
    with pytest.raises(errors.NonFiniteError,
                       match=r"at step 3 on replica\(s\) \[2\]"):
        mirrored.fit(x, y, batch_size=ROWS, shuffle=False, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 2
    assert all(np.isfinite(w.numpy()).all() for w in mirrored.weights)


@pytest.mark.parametrize("bad", ["nan", "gradient"])
def test_skip_step_keeps_weights_and_iterations(cpus, bad):
    mirrored = _mirrored(cpus, "skip_step")
    x, y = _data(bad)
    before = _state(mirrored)
    history, messages = _fit(mirrored, x, y)
    weights, iterations = _state(mirrored)
    assert _same(weights, before[0])
    assert iterations == before[1] == 0
    counts = mirrored.replica_history["batch"][0]["nonfinite"]
    assert [c > 0 for c in counts] == [r == BAD_REPLICA for r in range(4)]
    epoch = mirrored.replica_history["nonfinite"][0]
    assert list(np.asarray(epoch) > 0) == [False, False, True, False]
    assert len(messages) == 1
    assert "step 1 on replica(s) [2]" in messages[0]
    assert "skipped on all replicas" in messages[0]


def test_skip_step_then_clean_steps_train_on(cpus):
    mirrored = _mirrored(cpus, "skip_step")
    x, y = _data(None)
    bad_x, bad_y = _data("nan")
    x = np.concatenate([bad_x, x])
    y = np.concatenate([bad_y, y])
    _, messages = _fit(mirrored, x, y)
    assert int(mirrored.optimizer.iterations.numpy()) == 1
    assert all(np.isfinite(w.numpy()).all() for w in mirrored.weights)
    assert len(messages) == 1 and "step 1 on replica(s) [2]" in messages[0]
    assert mirrored.replica_history["batch"][1]["nonfinite"] == [0] * 4


def test_skip_step_matches_single_device_on_clean_batches(cpus):
    keras.utils.set_random_seed(7)
    mirrored = _mirrored(cpus, "skip_step")
    reference = _model()
    reference.set_weights(mirrored.model.get_weights())
    reference.compile(optimizer="adam", loss="mse")
    x, y = _data(None)
    bad_x, bad_y = _data("nan")
    _fit(mirrored, np.concatenate([bad_x, x]), np.concatenate([bad_y, y]))
    reference.fit(x, y, batch_size=ROWS, shuffle=False, verbose=0)
    for a, b in zip(mirrored.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_warn_applies_update_and_names_replica_and_step(cpus):
    mirrored = _mirrored(cpus, "warn")
    x, y = _data("nan")
    _, messages = _fit(mirrored, x, y)
    assert int(mirrored.optimizer.iterations.numpy()) == 1
    assert len(messages) == 1
    assert "at step 1 on replica(s) [2]" in messages[0]
    assert "the update was applied" in messages[0]


def test_other_replica_attribution(cpus):
    """The same NaN in row 1 (replica 0) is attributed to replica 0."""
    mirrored = _mirrored(cpus, "skip_step")
    x, y = _data(None)
    x[1, 2] = np.nan
    _, messages = _fit(mirrored, x, y)
    assert "on replica(s) [0]" in messages[0]


def test_clean_run_does_not_warn(cpus):
    mirrored = _mirrored(cpus, "raise")
    _, messages = _fit(mirrored, *_data(None))
    assert messages == []
    assert mirrored.replica_history["batch"][0]["nonfinite"] == [0] * 4


# -- train_on_batch behaves as fit (issue 16, defect 2) -------------------

def _dense(cpus, mode):
    """A plain Dense model (no `GradTrap`): the NaN row poisons replica 2."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus,
                                          on_nonfinite=mode)
    mirrored.compile(optimizer="adam", loss="mse")
    return mirrored


def _on_batch(mirrored, x, y):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mirrored.train_on_batch(x, y)
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning)]


def test_train_on_batch_raise(cpus):
    mirrored = _dense(cpus, "raise")
    before = _state(mirrored)
    with pytest.raises(errors.NonFiniteError,
                       match=r"at step 1 on replica\(s\) \[2\] \(counts "
                             r"\[\d+\]\); the update was skipped. Set "):
        mirrored.train_on_batch(*_data("nan"))
    assert _same(_state(mirrored)[0], before[0])
    assert _state(mirrored)[1] == 0


def test_train_on_batch_skip_step(cpus):
    mirrored = _dense(cpus, "skip_step")
    before = _state(mirrored)
    messages = _on_batch(mirrored, *_data("inf_target"))
    assert len(messages) == 1
    assert "at step 1 on replica(s) [2]" in messages[0]
    assert "the update was skipped on all replicas" in messages[0]
    assert _same(_state(mirrored)[0], before[0])
    assert _on_batch(mirrored, *_data(None)) == []
    assert _state(mirrored)[1] == 1


def test_train_on_batch_warn(cpus):
    mirrored = _dense(cpus, "warn")
    messages = _on_batch(mirrored, *_data("nan"))
    assert len(messages) == 1
    assert "at step 1 on replica(s) [2]" in messages[0]
    assert "the update was applied" in messages[0]
    assert _state(mirrored)[1] == 1


def test_weight_sum_merges_the_mask_as_keras_does():
    sw = tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = tf.constant([[True, False, True], [False, True, True]])
    assert float(arithmetic.weight_sum(sw)) == 21.0
    assert float(arithmetic.weight_sum(sw, mask)) == 15.0
    assert float(arithmetic.weight_sum(sw[:, :1], mask[:, :1, None])) == 1.0


def test_valued_as_mean_keeps_the_sum_s_gradient():
    w = tf.Variable([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        value = arithmetic.valued_as_mean(tf.reduce_sum(w * w), 6)
    assert float(value) == np.float32(14.0) / np.float32(6.0)
    np.testing.assert_array_equal(tape.gradient(value, w), [2.0, 4.0, 6.0])
