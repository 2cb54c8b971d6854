"""Row order and input preparation as the user's model's own `fit` has them.

On 4 logical CPUs, 61 rows in batches of 15: the last batch leaves three
replicas' shards empty.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import max_diff

import keras_mirror
from keras_mirror.wrapper import _model_methods

ROWS, BATCH = 61, 15


class Prepared(keras.Sequential):
    """A class whose `fit`, `evaluate` and `predict` prepare their input,
    as keras-hub's tasks do: batched in order, preprocessed, then Keras's."""

    def _dataset(self, x, y, batch_size):
        parts = (x * 2.0,) if y is None else (x * 2.0, y)
        return tf.data.Dataset.from_tensor_slices(parts).batch(
            batch_size or 32)

    def fit(self, x=None, y=None, batch_size=None, **kwargs):
        return super().fit(self._dataset(x, y, batch_size), **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, **kwargs):
        return super().evaluate(self._dataset(x, y, batch_size), **kwargs)

    def predict(self, x, batch_size=None, **kwargs):
        return super().predict(self._dataset(x, None, batch_size), **kwargs)


def _data(classes=3):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = rng.integers(0, classes, size=(ROWS,))
    return x, y


def _model(cls=keras.Sequential):
    keras.utils.set_random_seed(0)
    model = cls([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                 keras.layers.Dropout(0.25),
                 keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def _fit(fitter, model, x, y, seed=7, **kwargs):
    keras.utils.set_random_seed(seed)
    history = fitter.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                         **kwargs)
    return model.get_weights(), history.history


@pytest.mark.parametrize("shuffle,extra", [
    (True, {}),
    (True, {"validation_split": 0.2}),
    ("batch", {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}}),
    (True, {"sample_weight": np.linspace(0.1, 2.0, ROWS, dtype="float32")}),
])
def test_arrays_are_shuffled_as_plain_keras_shuffles_them(cpus, shuffle,
                                                          extra):
    x, y = _data()
    single = _model()
    expected, logs1 = _fit(single, single, x, y, shuffle=shuffle, **extra)
    model = _model()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    weights, logs2 = _fit(mirrored, model, x, y, shuffle=shuffle, **extra)
    assert max_diff(expected, weights) < 1e-5
    np.testing.assert_allclose(logs1["loss"], logs2["loss"], rtol=1e-5)
    # Another seed shuffles otherwise: the order is the seed's.
    other = _model()
    assert max_diff(expected, _fit(other, other, x, y, seed=8,
                                   shuffle=shuffle, **extra)[0]) > 1e-3


def test_a_class_that_prepares_its_input_trains_as_it_does(cpus):
    x, y = _data()
    single = _model(Prepared)
    expected, logs1 = _fit(single, single, x, y)  # fit's default shuffle
    reference = (single.evaluate(x, y, batch_size=BATCH, verbose=0),
                 single.predict(x, batch_size=BATCH, verbose=0))
    model = _model(Prepared)
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    weights, logs2 = _fit(mirrored, model, x, y)
    assert max_diff(expected, weights) < 1e-5
    np.testing.assert_allclose(logs1["loss"], logs2["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        mirrored.evaluate(x, y, batch_size=BATCH, verbose=0), reference[0],
        rtol=1e-5)
    np.testing.assert_allclose(
        mirrored.predict(x, batch_size=BATCH, verbose=0), reference[1],
        atol=1e-6)
    assert "fit" not in vars(keras.Model)  # the routing is undone


def test_the_routing_is_undone_when_the_call_fails(cpus):
    class Failing(keras.Sequential):
        def fit(self, *args, **kwargs):
            super().fit(*args, **kwargs)
            raise RuntimeError("after Keras's fit")

    model = _model(Failing)
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    x, y = _data()
    with pytest.raises(RuntimeError, match="after Keras's fit"):
        mirrored.fit(x, y, batch_size=BATCH, verbose=0)
    assert "fit" not in vars(keras.Model)
    assert mirrored.optimizer.iterations.numpy() == 5  # the wrapper's fit ran
    assert not _model_methods.overrides(_model(), "fit")
    assert _model_methods.overrides(model, "fit")


def test_keras_hub_image_classifier_as_plain_keras_fits_it(cpus):
    keras_hub = pytest.importorskip("keras_hub")

    def build():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3],
            stackwise_num_filters=[64], stackwise_num_blocks=[1],
            stackwise_num_strides=[1], block_type="basic_block",
            use_pre_activation=False, image_shape=(12, 12, 3))
        classifier = keras_hub.models.ImageClassifier(
            backbone=backbone, num_classes=3, preprocessor=None)
        classifier.compile(optimizer=keras.optimizers.Adam(1e-2),
                           loss="sparse_categorical_crossentropy")
        return classifier

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 12, 12, 3)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS,))
    single = build()
    expected, _ = _fit(single, single, x, y)  # fit's default shuffle
    model = build()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    weights, _ = _fit(mirrored, model, x, y)
    assert max_diff(expected, weights) < 1e-5  # 0.23 before
