"""What the user does to their model between wrapper calls takes effect.

Each test runs the same script twice: once on one device with the model's
own `fit`, once with the one-line change (`MirroredModel(model).fit`), and
the two must end on the same weights and logs. Between the calls the user
recompiles (the Keras fine-tuning guide), changes the loss, the learning
rate, `steps_per_execution`, or a layer's `trainable` flag.
"""

import keras
import numpy as np
import pytest
from keras import layers
from support.helpers import once

import keras_mirror

pytestmark = pytest.mark.usefixtures("execution")

TOL = 1e-5


def _data(rows=30, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6, 6, 3)).astype("float32")
    y = (rng.uniform(size=(rows, 1)) > 0.5).astype("float32")
    return x, y


def _transfer_model():
    """The guide's shape: a frozen base, a new head with Dropout.

    (No BatchNorm in the base: plain BatchNorm in training uses each
    shard's statistics, which is not one device's; see the README.)
    """
    keras.utils.set_random_seed(3)
    base = keras.Sequential([
        keras.Input((6, 6, 3)), layers.Conv2D(4, 3),
        layers.LayerNormalization(), layers.ReLU(),
        layers.GlobalAveragePooling2D()], name="base")
    base.trainable = False
    inputs = keras.Input((6, 6, 3))
    h = base(inputs, training=False)
    outputs = layers.Dense(1)(layers.Dropout(0.2)(h))
    return keras.Model(inputs, outputs), base


def _weights_equal(a, b):
    """`a` a model or its weights, `b` a model."""
    a = a.get_weights() if hasattr(a, "get_weights") else a
    diff = max(float(np.max(np.abs(u - v)))
               for u, v in zip(a, b.get_weights()))
    assert diff < TOL, diff


def _logs_equal(a, b):
    assert set(a) <= set(b)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=2e-6,
                                   err_msg=key)


def _fine_tune(fit_target, model, base, x, y):
    """The fine-tuning guide: train the head, unfreeze, recompile, train."""
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy()])
    target = fit_target(model)
    h1 = target.fit(x, y, batch_size=7, epochs=2, validation_data=(x, y),
                    shuffle=False, verbose=0).history
    base.trainable = True
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy()])
    h2 = target.fit(x, y, batch_size=7, epochs=2, validation_data=(x, y),
                    shuffle=False, verbose=0).history
    return h1, h2


def test_the_fine_tuning_guide_recompiles_after_unfreezing(cpus, one_device):
    x, y = _data()

    def single():
        model, base = _transfer_model()
        logs = _fine_tune(lambda m: m, model, base, x, y)
        return model.get_weights(), logs

    weights, logs1 = once(one_device, "fine_tuning", single)
    model, base = _transfer_model()
    logs2 = _fine_tune(keras_mirror.MirroredModel, model, base, x, y)
    _weights_equal(weights, model)
    for a, b in zip(logs1, logs2):
        _logs_equal(a, b)
    assert min(logs2[1]["val_loss"]) > 0.1  # not the stale tracker's 0


def _mlp():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((6,)), layers.Dense(8, "tanh"),
                             layers.Dense(1)])


def _mlp_data():
    rng = np.random.default_rng(1)
    return (rng.normal(size=(30, 6)).astype("float32"),
            rng.normal(size=(30, 1)).astype("float32"))


def _script(target_of, moves):
    """Compile MSE, fit, apply `moves(model)`, fit again; returns logs."""
    x, y = _mlp_data()
    model = _mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                  metrics=["mae"])
    target = target_of(model)
    logs = [target.fit(x, y, batch_size=7, shuffle=False, verbose=0).history]
    moves(model)
    logs.append(target.fit(x, y, batch_size=7, epochs=2, shuffle=False,
                           verbose=0).history)
    logs.append(target.evaluate(x, y, batch_size=7, verbose=0,
                                return_dict=True))
    return model, logs


def _same_script(moves, cache=None, key=None):
    """The script on one device and wrapped; with `cache`, one device's run
    is kept under `key` for the other path."""
    def single():
        model, logs = _script(lambda m: m, moves)
        return model.get_weights(), logs

    weights, logs1 = once(cache, key, single) if cache is not None \
        else single()
    model, logs2 = _script(keras_mirror.MirroredModel, moves)
    _weights_equal(weights, model)
    for a, b in zip(logs1, logs2):
        _logs_equal(a, b)
    return logs2


def test_a_new_loss_after_wrapping_trains(cpus, one_device):
    logs = _same_script(lambda m: m.compile(
        optimizer=keras.optimizers.SGD(0.05), loss="mae"), one_device, "mae")
    # MAE logged as MAE (the compiled metric equals the loss now).
    np.testing.assert_allclose(logs[1]["loss"], logs[1]["mae"], rtol=1e-5)


def test_a_new_optimizer_and_steps_per_execution(cpus, one_device):
    _same_script(lambda m: m.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"],
        steps_per_execution=2), one_device, "adam_spe")


def test_a_learning_rate_set_between_calls(cpus, one_device):
    def moves(model):
        model.optimizer.learning_rate = 0.2

    _same_script(moves, one_device, "learning_rate")


def test_trainable_changed_and_recompiled(cpus, one_device):
    def moves(model):
        model.layers[0].trainable = False
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                      metrics=["mae"])

    _same_script(moves, one_device, "trainable")


def test_trainable_changed_without_recompile_warns_as_keras_does(cpus):
    def moves(model):
        model.layers[0].trainable = False

    with pytest.warns(UserWarning, match=(
            r"A layer.s `trainable` state has changed since the model was "
            r"compiled.*Changed layers: \[.dense")):
        _same_script(moves)


def test_an_optimizer_replaced_without_compiling_is_refused(cpus):
    x, y = _mlp_data()
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.fit(x, y, batch_size=7, verbose=0)
    before = [w.copy() for w in model.get_weights()]
    model.optimizer = keras.optimizers.Adam()
    with pytest.raises(ValueError, match=(
            r"The wrapped model's `optimizer` was replaced after it was "
            r"compiled.*Received: model.optimizer=<keras.src.optimizers.adam"
            r".Adam")):
        mirrored.fit(x, y, batch_size=7, verbose=0)
    assert all(np.array_equal(a, b)
               for a, b in zip(before, model.get_weights()))
    model.compile(optimizer=model.optimizer, loss="mse")
    mirrored.fit(x, y, batch_size=7, verbose=0)  # trains again


def test_compiling_the_model_after_wrapping_an_uncompiled_one(cpus):
    x, y = _mlp_data()
    single = _mlp()
    single.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    single.fit(x, y, batch_size=7, shuffle=False, verbose=0)
    model = _mlp()
    mirrored = keras_mirror.MirroredModel(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    mirrored.fit(x, y, batch_size=7, shuffle=False, verbose=0)
    _weights_equal(single, model)
