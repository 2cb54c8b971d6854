"""Inputs Keras takes, trained through `MirroredModel` as Keras trains them.

Each case makes the same call on a plain model (one device) and on the
same model wrapped over 4 logical CPUs (`support.parity`) and compares
results and weights; where Keras refuses an input, the wrapper raises
Keras's own error (same class, same message). Issue #38 item 3.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from support import parity

import keras_mirror

RNG = np.random.default_rng(3)


def _array(*shape):
    return RNG.normal(size=shape).astype("float32")


# -- a model without trainable weights (Keras warns and runs) -------------

def _weightless():
    model = keras.Sequential([keras.Input((4,)), layers.Dropout(0.5),
                              layers.Activation("relu")])
    model.compile(loss="mse", metrics=["mae"])
    return model


def test_a_model_without_trainable_weights_runs_and_warns(cpus):
    x = _array(10, 4)

    def call(model):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            history = model.fit(x, x, epochs=2, batch_size=4, verbose=0)
            on_batch = model.train_on_batch(x, x)
        said = {str(w.message) for w in seen}
        assert "The model does not have any trainable weights." in said
        return [history, on_batch, model.evaluate(x, x, verbose=0),
                model.predict(x, verbose=0)]

    parity.assert_same(*parity.both(_weightless, call, cpus))


# -- ragged and sparse inputs -----------------------------------------------

class RaggedSum(keras.Model):
    """Sums each ragged row, then one weight: ragged in, dense out."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(1,), initializer="ones")

    def call(self, x):
        return tf.reduce_sum(x, axis=1, keepdims=True) * self.w


def _ragged_loss(y_true, y_pred):
    """A loss of ragged targets: each target row's sum against the output."""
    target = tf.reduce_sum(y_true, axis=1, keepdims=True)
    return tf.reduce_mean(tf.square(target - y_pred), axis=-1)


def _ragged_model():
    model = RaggedSum()
    model.compile(optimizer="sgd", loss=_ragged_loss)
    return model


RAGGED_X = tf.ragged.constant(
    [[1.0], [2.0, 3.0], [0.5, 0.5, 1.0], [2.0], [-1.0, 1.0], [0.2]])
RAGGED_Y = tf.ragged.constant(
    [[0.5, 1.0], [1.0], [2.0, 1.0, 1.0], [0.1], [0.0, 0.3], [1.0]])


def test_ragged_inputs_and_targets_train_exactly(cpus):
    def call(model):
        return [model.fit(RAGGED_X, RAGGED_Y, batch_size=5, epochs=2,
                          verbose=0),
                model.evaluate(RAGGED_X, RAGGED_Y, batch_size=5, verbose=0),
                model.predict(RAGGED_X, batch_size=5, verbose=0),
                model.train_on_batch(RAGGED_X, RAGGED_Y)]

    parity.assert_same(*parity.both(_ragged_model, call, cpus))


class RaggedTwice(keras.Model):
    """Ragged in, ragged out (Keras's `test_trainer_with_raggeds`), with a
    weight."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return x * self.w


def _ragged_mse(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


def test_ragged_outputs_are_predicted_as_keras_does(cpus):
    def build():
        model = RaggedTwice()
        model.compile(optimizer="sgd", loss=_ragged_mse)
        return model

    def call(model):
        history = model.fit(RAGGED_X, RAGGED_X * 2.0, batch_size=5,
                            verbose=0)
        out = model.predict(RAGGED_X, batch_size=5, verbose=0)
        assert isinstance(out, tf.RaggedTensor)
        return [history, out]

    parity.assert_same(*parity.both(build, call, cpus))


def _sparse_model():
    inputs = keras.Input((5,), sparse=True)
    model = keras.Model(inputs, layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_sparse_inputs_train_exactly(cpus, kind):
    dense = np.where(_array(9, 5) > 0.3, _array(9, 5), 0.0)
    x, y = tf.sparse.from_dense(dense.astype("float32")), _array(9, 2)

    def call(model):
        if kind == "dataset":
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
            return [model.fit(data, epochs=2, verbose=0),
                    model.evaluate(data, verbose=0),
                    model.predict(data.map(lambda a, b: a), verbose=0)]
        return [model.fit(x, y, batch_size=6, epochs=2, verbose=0),
                model.evaluate(x, y, batch_size=6, verbose=0),
                model.predict(x, batch_size=6, verbose=0),
                model.train_on_batch(x, y)]

    parity.assert_same(*parity.both(_sparse_model, call, cpus))


# -- per-output sample weights ------------------------------------------------

def _two_outputs():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, {"a": layers.Dense(1, name="a")(inputs),
                                 "b": layers.Dense(2, name="b")(inputs)})
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mae"})
    return model


def _two_outputs_list():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, [layers.Dense(1, name="a")(inputs),
                                 layers.Dense(2, name="b")(inputs)])
    model.compile(optimizer="sgd", loss=["mse", "mae"])
    return model


X3, YA, YB = _array(10, 3), _array(10, 1), _array(10, 2)
W1, W2 = (RNG.uniform(0.1, 2.0, size=(10,)).astype("float32")
          for _ in range(2))


def test_per_output_sample_weights_as_a_dict(cpus):
    def call(model):
        y, sw = {"a": YA, "b": YB}, {"a": W1, "b": W2}
        return [model.fit(X3, y, sample_weight=sw, batch_size=6, verbose=0),
                model.train_on_batch(X3, y, sample_weight=sw,
                                     return_dict=True),
                model.test_on_batch(X3, y, sample_weight=sw,
                                    return_dict=True),
                model.evaluate(X3, y, sample_weight=sw, verbose=0,
                               return_dict=True)]

    parity.assert_same(*parity.both(_two_outputs, call, cpus))


def test_per_output_sample_weights_as_a_list(cpus):
    def call(model):
        return [model.train_on_batch(X3, [YA, YB], sample_weight=[W1, W2]),
                model.fit(X3, [YA, YB], sample_weight=[W1, W2],
                          batch_size=6, verbose=0),
                model.test_on_batch(X3, [YA, YB], sample_weight=[W1, W2])]

    parity.assert_same(*parity.both(_two_outputs_list, call, cpus))


def test_class_weights_of_a_dict_as_sample_weight_are_still_refused(cpus):
    model = keras.Sequential([keras.Input((3,)), layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    with pytest.raises(ValueError, match=r"Received: sample_weight=\{0: "):
        mirrored.fit(X3, YA, sample_weight={0: 1.0, 1: 2.0}, verbose=0)


# -- optional and missing inputs, adjusted ranks --------------------------

class OptionalInputLayer(layers.Layer):
    """Keras's own `models/model_test.py` layer: `o` may be None."""

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(2)

    def call(self, x, o=None):
        return self.dense(x if o is None else x + o)


def _optional_model():
    x = keras.Input((2,), name="x")
    o = keras.Input((2,), name="o", optional=True)
    model = keras.Model({"x": x, "o": o}, OptionalInputLayer()(x, o))
    model.compile(loss="mse", optimizer="adam")
    return model


@pytest.mark.parametrize("given", [None, "array"])
def test_optional_input_given_none_or_an_array(cpus, given):
    x = _array(6, 2)
    o = None if given is None else _array(6, 2)
    y = _array(6, 2)

    def call(model):
        inputs = {"x": x, "o": o}
        return [model.fit(inputs, y, batch_size=5, verbose=0),
                model.evaluate(inputs, y, batch_size=5, verbose=0),
                model.predict(inputs, batch_size=5, verbose=0),
                model.train_on_batch(inputs, y),
                model.predict_on_batch(inputs)]

    parity.assert_same(*parity.both(_optional_model, call, cpus))


def test_optional_input_none_from_a_generator(cpus):
    x, y = _array(5, 2), _array(5, 2)

    def generator(with_y=True):
        for _ in range(3):
            yield ({"x": x, "o": None},) + ((y,) if with_y else ())

    def call(model):
        return [model.fit(generator(), verbose=0),
                model.evaluate(generator(), verbose=0),
                model.predict(generator(with_y=False), verbose=0)]

    parity.assert_same(*parity.both(_optional_model, call, cpus))


def _two_required(form):
    def build():
        a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
        inputs = {"a": a, "b": b} if form == "dict" else [a, b]
        model = keras.Model(inputs, layers.Dense(1)(layers.Add()([a, b])))
        model.compile(optimizer="sgd", loss="mse")
        return model
    return build


METHODS = {
    "fit": lambda m, x, y: m.fit(x, y, verbose=0),
    "evaluate": lambda m, x, y: m.evaluate(x, y, verbose=0),
    "predict": lambda m, x, y: m.predict(x, verbose=0),
    "train_on_batch": lambda m, x, y: m.train_on_batch(x, y),
    "test_on_batch": lambda m, x, y: m.test_on_batch(x, y),
    "predict_on_batch": lambda m, x, y: m.predict_on_batch(x),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("form, missing", [("dict", "a"), ("list", "b")])
def test_a_required_input_given_none_gets_keras_error(cpus, method, form,
                                                      missing):
    arrays = {"a": _array(4, 2), "b": _array(4, 2)}
    arrays[missing] = None
    x = arrays if form == "dict" else [arrays["a"], arrays["b"]]
    y = _array(4, 1)
    call = METHODS[method]
    keras_error = parity.error_of(
        lambda: call(_two_required(form)(), x, y))
    mirrored = keras_mirror.MirroredModel(_two_required(form)(),
                                          devices=cpus)
    assert keras_error[0] is ValueError
    assert parity.error_of(lambda: call(mirrored, x, y)) == keras_error


def _one_required():
    x = keras.Input((3,), name="x")
    model = keras.Model(x, layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("x", [None, [None], {"x": None}],
                         ids=["none", "list", "dict"])
def test_no_array_at_all_gets_keras_error(cpus, method, x):
    """`fit([None], y)` (Keras's own `test_required_none_raises_in_fit`):
    Keras's `ValueError`, not a `StopIteration` from counting rows."""
    call = METHODS[method]
    y = _array(4, 1)
    keras_error = parity.error_of(lambda: call(_one_required(), x, y))
    mirrored = keras_mirror.MirroredModel(_one_required(), devices=cpus)
    assert parity.error_of(lambda: call(mirrored, x, y)) == keras_error


def _declared_one():
    inputs = keras.Input((1,))
    model = keras.Model(inputs, layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_features_of_rank_one_for_an_input_of_shape_none_1(cpus):
    x, y = _array(9), _array(9, 2)

    def call(model):
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
        return [model.fit(x, y, batch_size=5, epochs=2, verbose=0),
                model.fit(data, verbose=0),
                model.evaluate(x, y, batch_size=5, verbose=0),
                model.predict(x, batch_size=5, verbose=0),
                model.train_on_batch(x, y)]

    parity.assert_same(*parity.both(_declared_one, call, cpus))


# -- grouped convolutions ----------------------------------------------------

def _grouped():
    inputs = keras.Input((6, 6, 4))
    hidden = layers.Conv2D(4, 3, groups=2)(inputs)
    model = keras.Model(inputs, layers.Dense(1)(layers.Flatten()(hidden)))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def test_grouped_convolutions_in_every_method(cpus):
    x, y = _array(7, 6, 6, 4), _array(7, 1)

    def call(model):
        return [model.fit(x, y, batch_size=5, epochs=2, verbose=0),
                model.evaluate(x, y, batch_size=5, verbose=0),
                model.predict(x, batch_size=5, verbose=0),
                model.train_on_batch(x, y),
                model.test_on_batch(x, y),
                model.predict_on_batch(x)]

    parity.assert_same(*parity.both(_grouped, call, cpus))


# -- string inputs through a lookup layer ---------------------------------

WORDS = tf.constant([["a"], ["b"], ["c"], ["a"], ["d"], ["b"], ["c"]])
WORD_Y = np.arange(7, dtype="float32")[:, None]


def _lookup_model():
    inputs = keras.Input((1,), dtype="string")
    hot = layers.StringLookup(vocabulary=["a", "b", "c"],
                              output_mode="one_hot")(inputs)
    model = keras.Model(inputs, layers.Dense(1)(layers.Flatten()(hot)))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("kind", ["tensor", "dataset"])
def test_string_inputs_through_a_lookup_train_exactly(cpus, kind):
    """Strings for a `StringLookup` (an out-of-vocabulary word too), in
    batches of 3 on 4 replicas (an empty shard each step)."""
    def data():
        if kind == "tensor":
            return (WORDS, WORD_Y), {"batch_size": 3}
        return (tf.data.Dataset.from_tensor_slices(
            (WORDS, WORD_Y)).batch(3),), {}

    def call(model):
        args, kwargs = data()
        return [model.fit(*args, epochs=2, shuffle=False, verbose=0,
                          **kwargs),
                model.evaluate(*args, verbose=0, **kwargs),
                model.predict(WORDS, batch_size=3, verbose=0)]

    parity.assert_same(*parity.both(_lookup_model, call, cpus))
