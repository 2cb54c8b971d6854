"""One update for N replicas (`steps/_one_update.py`), on the strategy path.

The optimizer's `apply` is traced once and every replica calls that trace
on its own copies of the variables: `update_step` runs once per variable,
not once per variable and device (stock Keras under a `MirroredStrategy`),
and the weights equal one device's, with uneven and empty shards (global
batches of 5, 1, 2, 3 rows over 4 replicas). Where one trace cannot serve
(a missing gradient, `run_eagerly`), the step updates per device, as
stock Keras does, and is still exact; a sparse gradient (an `Embedding`'s)
is traced once too. (The optimizers of `tests/test_mirrored_model.py`
run the same path there.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from support.helpers import batches
from support.helpers import max_diff

import keras_mirror
from keras_mirror.steps import _one_update

TOL = 1e-5
SIZES = (5, 1, 2, 3)

OPTIMIZERS = {
    "rmsprop_centered": lambda: keras.optimizers.RMSprop(
        0.01, momentum=0.5, centered=True),
    "nadam_clipvalue": lambda: keras.optimizers.Nadam(0.01, clipvalue=0.1),
    "lion": lambda: keras.optimizers.Lion(0.003),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "sgd_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5),
        momentum=0.9, nesterov=True),
    # Their updates branch (`ops.cond`). Gradient accumulation failed with
    # stock Keras's per-device update under a MirroredStrategy (a
    # `merge_call` inside a `cond`).
    "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=64.0),
    "accumulation": lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=3),
    # EMA's end of `fit` failed on mirrored variables ("tuple indices must
    # be integers or slices, not MirroredVariable"): the optimizer updates
    # through the mirroring strategy while its variables are mirrored
    # (`_compat.distributes_through`), which writes every copy.
    "ema": lambda: keras.optimizers.Adam(
        0.01, use_ema=True, ema_overwrite_frequency=3),
}


def _model(embedding=False):
    if embedding:
        return keras.Sequential([
            keras.Input((3,), dtype="int32"), layers.Embedding(10, 4),
            layers.Flatten(), layers.Dense(3)])
    return keras.Sequential([
        keras.Input((6,)),
        layers.Dense(16, activation="relu",
                     kernel_constraint=keras.constraints.MaxNorm(0.5)),
        layers.Dense(3)])


def _data(embedding=False):
    rng = np.random.default_rng(0)
    rows = sum(SIZES)
    x = (rng.integers(0, 10, (rows, 3)).astype("int32") if embedding
         else rng.normal(size=(rows, 6)).astype("float32"))
    y = rng.normal(size=(rows, 3)).astype("float32")
    return batches(x, y, SIZES)


class _Counted:
    """Counts the optimizer's `update_step` calls (each one a trace)."""

    def __init__(self, optimizer):
        inner = getattr(optimizer, "inner_optimizer", None) or optimizer
        self.calls = 0
        step = inner.update_step

        def update_step(*args, **kwargs):
            self.calls += 1
            return step(*args, **kwargs)

        inner.update_step = update_step


def _train(make, wrap, embedding=False, **kwargs):
    keras.utils.set_random_seed(7)
    model = _model(embedding)
    model.compile(optimizer=make(), loss="mse")
    counted = _Counted(model.optimizer)
    target = model
    if wrap:
        target = keras_mirror.MirroredModel(model, execution="strategy",
                                            **kwargs)
    target.fit(_data(embedding), epochs=2, verbose=0)
    return target, model, counted


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_update_is_traced_once_for_every_replica(name):
    _, reference, _ = _train(OPTIMIZERS[name], wrap=False)
    mirrored, model, counted = _train(OPTIMIZERS[name], wrap=True)
    assert len(mirrored.devices) == 4
    update = mirrored._step_state.one_update_last
    assert update.function.experimental_get_tracing_count() == 1
    # Once per variable: not once per variable and replica (4 x 4).
    assert counted.calls == len(model.trainable_variables) == 4
    assert mirrored._step_state.one_update_reason is None
    assert max_diff(reference.get_weights(), model.get_weights()) < TOL
    for a, b in zip(reference.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=a.path)
    for v in model.weights:  # every replica's copy holds the same values
        copies = mirrored._strategy.experimental_local_results(v.value)
        for copy in copies[1:]:
            np.testing.assert_array_equal(np.array(copy),
                                          np.array(copies[0]))
    assert int(model.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()) > 0


@pytest.mark.parametrize("name", ["adam", "accumulation", "adamw"])
def test_a_sparse_gradient_is_traced_once_too(name):
    """An `Embedding`'s gradient (`IndexedSlices`, a different row count on
    each replica) goes through the same one trace. With gradient
    accumulation, stock Keras's per-device update crashed here (a
    `merge_call` inside a `cond`)."""
    make = {"adam": lambda: keras.optimizers.Adam(0.01),
            "accumulation": OPTIMIZERS["accumulation"],
            "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
            }[name]
    _, reference, _ = _train(make, wrap=False, embedding=True)
    mirrored, model, counted = _train(make, wrap=True, embedding=True)
    assert mirrored._step_state.one_update_reason is None
    update = mirrored._step_state.one_update_last
    assert update.function.experimental_get_tracing_count() == 1
    assert counted.calls == len(model.trainable_variables) == 3
    assert max_diff(reference.get_weights(), model.get_weights()) < TOL
    for a, b in zip(reference.optimizer.variables, model.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=a.path)


def test_a_skipped_step_keeps_every_copy():
    """`on_nonfinite="skip_step"`: a NaN gradient changes no copy."""
    keras.utils.set_random_seed(7)
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    mirrored = keras_mirror.MirroredModel(model, execution="strategy",
                                          on_nonfinite="skip_step")
    x = np.ones((5, 6), "float32")
    y = np.zeros((5, 3), "float32")
    mirrored.train_on_batch(x, y)
    before = [np.array(c) for v in model.variables + model.optimizer.variables
              for c in mirrored._strategy.experimental_local_results(
                  v.value)]
    y_nan = y.copy()
    y_nan[3] = np.nan  # on replica 2 of 4 (shards 2/1/1/1)
    mirrored.train_on_batch(x, y_nan)
    after = [np.array(c) for v in model.variables + model.optimizer.variables
             for c in mirrored._strategy.experimental_local_results(v.value)]
    update = mirrored._step_state.one_update_last
    assert update.function.experimental_get_tracing_count() == 1
    assert mirrored._step_state.one_update_reason is None
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations.numpy()) == 1
    mirrored.train_on_batch(x, y)  # a finite step updates again
    assert int(model.optimizer.iterations.numpy()) == 2


def test_reasons_name_what_branches():
    strategy = tf.distribute.get_strategy()
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    assert _one_update.reason_against(
        model.optimizer, model.trainable_variables, grads,
        strategy) == "the optimizer is not built"
    model.optimizer.build(model.trainable_variables)
    sparse = [tf.IndexedSlices(tf.zeros((1, 16)), tf.constant([0]))]
    assert _one_update.reason_against(
        model.optimizer, model.trainable_variables, sparse + grads[1:],
        strategy) == "the step runs eagerly (`run_eagerly=True`)"
    assert _one_update.reason_against(
        model.optimizer, model.trainable_variables, [None] + grads[1:],
        strategy) == "a gradient is missing"
