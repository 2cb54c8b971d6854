"""Mistakes made on a wrapper that has trained one step: `REFUSALS`.

Shared by `tests/wrapper/test_validate.py` (each refusal leaves the model
untouched), `tests/wrapper/test_files.py` and `tests/test_errors.py` (the
table behind `docs/errors.md`).
"""

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import keras_mirror
from keras_mirror import errors

X = np.linspace(-1, 1, 24, dtype="float32").reshape(8, 3)
Y = np.ones((8, 1), "float32")
LABELS = np.array([0, 1, 2, 0, 1, 2, 0, 1])


def regressor():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                             keras.layers.Dense(1)])


def _classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])


KINDS = {
    "regressor": (regressor, "mse", Y, {}),
    "classifier": (_classifier, "sparse_categorical_crossentropy", LABELS,
                   {}),
    "per_replica": (regressor, "mse", Y, {"batch": "per_replica"}),
}


def trained(cpus, kind="regressor"):
    """A wrapper of `kind` after one training step, and its targets."""
    build, loss, y, kwargs = KINDS[kind]
    mirrored = keras_mirror.MirroredModel(build(), devices=cpus, **kwargs)
    mirrored.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    mirrored.fit(X, y, batch_size=8, epochs=1, verbose=0)
    return mirrored, y


def state(mirrored):
    """Every weight and optimizer variable, as NumPy arrays."""
    return [v.numpy().copy() for v in
            mirrored.model.variables + mirrored.optimizer.variables]


def assert_keras_style(message, argument):
    """The message names the argument (in backticks) and the value."""
    assert "Received:" in message
    assert f"`{argument.split('[')[0]}" in message or argument in message


def assert_untouched_and_trains(mirrored, y, before):
    after = state(mirrored)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
    steps = int(mirrored.optimizer.iterations.numpy())
    mirrored.fit(X, y, batch_size=8, epochs=1, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == steps + 1
    assert np.all(np.isfinite(mirrored.model.get_weights()[0]))


def _generator(*feature_counts):
    return ((np.ones((2, f), "float32"), Y[:2]) for f in feature_counts)


def _fit(**kwargs):
    def make(m, y):
        args = dict(x=X, y=y, batch_size=8, epochs=1, verbose=0)
        args.update(kwargs)
        m.fit(**args)
    return make


def _dataset_weights(m, y):
    m.fit(tf.data.Dataset.from_tensors((X, Y, np.ones((8, 5), "float32"))),
          verbose=0)


def in_other_strategy(m, y):
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        m.fit(X, y, batch_size=8, verbose=0)


def _evaluate_in_other_strategy(m, y):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        m.evaluate(X, y, verbose=0)


def _predict_in_other_strategy(m, y):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        m.predict_on_batch(X)


@dataclasses.dataclass
class Refusal:
    argument: str
    value: str
    make: Callable
    error: type
    match: str
    kind: str = "regressor"
    # False where the mistake is only seen after some steps (a generator
    # read lazily, as Keras reads it): the error is clear, the steps
    # before it trained.
    untouched: bool = True


REFUSALS = {
    "epochs_negative": Refusal(
        "epochs", "-1", _fit(epochs=-1), ValueError,
        r"`epochs` must be a non-negative integer .*Received: epochs=-1"),
    "epochs_float": Refusal(
        "epochs", "2.5", _fit(epochs=2.5), ValueError,
        r"`epochs` must be a non-negative integer .*Received: epochs=2.5"),
    "initial_epoch_beyond_epochs": Refusal(
        "initial_epoch", "3 with epochs=2",
        _fit(epochs=2, initial_epoch=3), ValueError,
        r"`initial_epoch` must be an integer in \[0, epochs=2\].*"
        r"Received: initial_epoch=3"),
    "validation_split_negative": Refusal(
        "validation_split", "-0.2", _fit(validation_split=-0.2), ValueError,
        r"`validation_split` must be a number in \[0, 1\).*"
        r"Received: validation_split=-0.2"),
    "validation_freq_zero": Refusal(
        "validation_freq", "0",
        _fit(validation_data=(X, Y), validation_freq=0), ValueError,
        r"`validation_freq` must be a positive integer.*"
        r"Received: validation_freq=0"),
    "class_weight_string": Refusal(
        "class_weight", "{0: 'heavy'}", _fit(class_weight={0: "heavy"}),
        ValueError, r"`class_weight` must map each class index to a "
        r"number\. Received: class_weight\[0\]='heavy'", "classifier"),
    "callbacks_string": Refusal(
        "callbacks", "'tensorboard'", _fit(callbacks="tensorboard"),
        ValueError, r"`callbacks` must be a list of "
        r"`keras.callbacks.Callback` objects.*"
        r"Received: callbacks='tensorboard'"),
    "evaluate_x_string": Refusal(
        "x", "'data.csv' in `evaluate`",
        lambda m, y: m.evaluate("data.csv", verbose=0), ValueError,
        r"`x` must be arrays, .*not a string\. Received: x='data.csv'"),
    "predict_x_string": Refusal(
        "x", "'data.csv' in `predict`",
        lambda m, y: m.predict("data.csv", verbose=0), ValueError,
        r"`x` must be arrays, .*not a string\. Received: x='data.csv'"),
    "evaluate_batch_size_zero": Refusal(
        "batch_size", "0 in `evaluate`",
        lambda m, y: m.evaluate(X, y, batch_size=0, verbose=0), ValueError,
        r"`batch_size` must be a positive integer or None\. "
        r"Received: batch_size=0"),
    "predict_batch_size_negative": Refusal(
        "batch_size", "-1 in `predict`",
        lambda m, y: m.predict(X, batch_size=-1, verbose=0), ValueError,
        r"`batch_size` must be a positive integer or None\. "
        r"Received: batch_size=-1"),
    "labels_out_of_range": Refusal(
        "y", "label 5 for 3 classes",
        _fit(y=np.array([0, 1, 2, 5, 0, 1, 2, 0])), ValueError,
        r"`y` must hold class indices in \[0, 3\) .*"
        r"Received: y with labels from 0 to 5", "classifier"),
    "labels_negative_in_evaluate": Refusal(
        "y", "label -1 in `evaluate`",
        lambda m, y: m.evaluate(X, np.full(8, -1), verbose=0), ValueError,
        r"`y` must hold class indices in \[0, 3\) .*"
        r"Received: y with labels from -1 to -1", "classifier"),
    "sparse_y_one_hot": Refusal(
        "y", "shape (8, 5) for sparse_categorical_crossentropy",
        _fit(y=np.zeros((8, 5), "float32")), ValueError,
        r"`y` must hold one class index per output position .*"
        r"Received: y.shape=\(8, 5\)", "classifier"),
    "sample_weight_shape": Refusal(
        "sample_weight", "shape (8, 3) for a (8, 1) target",
        _fit(sample_weight=np.ones((8, 3), "float32")), ValueError,
        r"`sample_weight` must hold one weight per row .*"
        r"Received: sample_weight.shape=\(8, 3\) with y.shape=\(8, 1\)"),
    "dataset_sample_weight_shape": Refusal(
        "sample_weight", "a dataset's weights of shape (8, 5)",
        _dataset_weights, ValueError,
        r"`sample_weight` must hold one weight per row .*"
        r"Received: sample_weight.shape=\(8, 5\) with y.shape=\(8, 1\)"),
    "sample_weight_balanced": Refusal(
        "sample_weight", "'balanced'", _fit(sample_weight="balanced"),
        ValueError, r"`sample_weight` must be an array of weights.*"
        r"Received: sample_weight='balanced'"),
    "generator_shape_change": Refusal(
        "x", "a generator of (2, 3) batches, then a (2, 4) one",
        lambda m, y: m.fit(_generator(3, 3, 4, 3), verbose=0),
        tf.errors.InvalidArgumentError,
        r"Every batch of the generator `x` must have the shape \(None, 3\) "
        r"\(None: any size\) of the model's input: batch 2 differs\. "
        r"Received: x.shape=\(2, 4\) in batch 2", untouched=False),
    "per_replica_generator_features": Refusal(
        "x", "a per_replica generator alternating 3 and 4 features",
        lambda m, y: m.fit(_generator(*[3, 4] * 4), verbose=0), ValueError,
        r"Every batch of the generator `x` must have the shape \(None, 3\) "
        r".*batch 1 differs\. Received: x.shape=\(2, 4\) in batch 1",
        "per_replica"),
    "steps_per_execution_zero": Refusal(
        "steps_per_execution", "0",
        lambda m, y: m.compile(optimizer="adam", loss="mse",
                               steps_per_execution=0), ValueError,
        r"`steps_per_execution` must be a positive integer\. "
        r"Received: steps_per_execution=0"),
    "fit_in_other_strategy_scope": Refusal(
        "fit", "called inside MirroredStrategy.scope()",
        in_other_strategy, errors.StrategyScopeError,
        r"`MirroredModel.fit` must be called outside any other "
        r"`tf.distribute.Strategy.scope\(\)`.*Received: fit called inside "
        r"MirroredStrategy.scope\(\)"),
    "evaluate_in_other_strategy_scope": Refusal(
        "evaluate", "called inside OneDeviceStrategy.scope()",
        _evaluate_in_other_strategy, errors.StrategyScopeError,
        r"`MirroredModel.evaluate` must be called outside.*Received: "
        r"evaluate called inside OneDeviceStrategy.scope\(\)"),
    "predict_on_batch_in_other_strategy_scope": Refusal(
        "predict_on_batch", "called inside OneDeviceStrategy.scope()",
        _predict_in_other_strategy, errors.StrategyScopeError,
        r"`MirroredModel.predict_on_batch` must be called outside.*"
        r"Received: predict_on_batch called inside "
        r"OneDeviceStrategy.scope\(\)"),
}
