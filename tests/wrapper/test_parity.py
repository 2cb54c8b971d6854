"""A parity matrix: the same call through plain Keras and `MirroredModel`.

For each input kind (NumPy arrays, dicts and lists of arrays, a batched
`tf.data.Dataset`, a Python generator, a `keras.utils.PyDataset`, ragged
and sparse tensors, None for an optional input) and each argument of
`fit`, `evaluate`, `predict` and `*_on_batch`, the call is made on a plain
model on one device and on the same model wrapped over the 4 logical CPUs;
returned losses, metrics and predictions, `History` keys and values and
the final weights must agree within 1e-5 (`support.parity`). Each model
pair is built once per module and put back on its initial weights before
each call, so that the wrapper's steps are traced once per pair.

Row order: every call but `shuffle_true` passes `shuffle=False` (or its
input is not shuffled by Keras); `shuffle_true` checks that one seed
shuffles arrays into the same batches on both (issue #37 owns the rest).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from support import parity

ROWS = 13  # 4 replicas: uneven shards, and a last batch with empty ones
RNG = np.random.default_rng(38)
X = RNG.normal(size=(ROWS, 4)).astype("float32")
Y = RNG.integers(0, 3, size=(ROWS,)).astype("int32")
W = RNG.uniform(0.1, 2.0, size=(ROWS,)).astype("float32")
XV = RNG.normal(size=(7, 4)).astype("float32")
YV = RNG.integers(0, 3, size=(7,)).astype("int32")
CLASS_WEIGHT = {0: 1.0, 1: 2.0, 2: 0.5}


def _classifier():
    model = keras.Sequential([keras.Input((4,)),
                              layers.Dense(8, activation="tanh"),
                              layers.Dense(3)])
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], weighted_metrics=["accuracy"])
    return model


def _two_inputs(form):
    def build():
        a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
        hidden = layers.Dense(5, activation="tanh")(
            layers.Concatenate()([a, b]))
        inputs = {"a": a, "b": b} if form == "dict" else [a, b]
        model = keras.Model(inputs, layers.Dense(3)(hidden))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model
    return build


class RaggedSum(keras.Model):
    """Sums each ragged row, times one weight: ragged in, dense out."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(1,), initializer="ones")

    def call(self, x):
        return tf.reduce_sum(x, axis=1, keepdims=True) * self.w


def _ragged():
    model = RaggedSum()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def _sparse():
    inputs = keras.Input((4,), sparse=True)
    model = keras.Model(inputs, layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


class OptionalAdd(layers.Layer):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(3)

    def call(self, x, o=None):
        return self.dense(x if o is None else x + o)


def _optional():
    x = keras.Input((4,), name="x")
    o = keras.Input((4,), name="o", optional=True)
    model = keras.Model({"x": x, "o": o}, OptionalAdd()(x, o))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


RAGGED_X = tf.ragged.constant([[float(i)] * (i % 3 + 1) for i in range(9)])
RAGGED_Y = RNG.normal(size=(9, 1)).astype("float32")
SPARSE_X = tf.sparse.from_dense(np.where(X > 0.5, X, 0.0))
Y3 = RNG.normal(size=(ROWS, 3)).astype("float32")
XB = RNG.normal(size=(ROWS, 2)).astype("float32")

BUILDS = {
    "classifier": (_classifier, None),
    "dict": (_two_inputs("dict"), None),
    "list": (_two_inputs("list"), None),
    "ragged": (_ragged, RAGGED_X[:1]),
    "sparse": (_sparse, None),
    "optional": (_optional, None),
}


@pytest.fixture(scope="module")
def pairs():
    """Model pairs by name, built on first use (one per module)."""
    return {}


def _pair(pairs, name, cpus):
    if name not in pairs:
        build, sample = BUILDS[name]
        pairs[name] = parity.Pair(build, cpus, sample=sample)
    return pairs[name]


def _fit(**kwargs):
    kwargs = {"batch_size": 5, "verbose": 0, **kwargs}
    return lambda m: m.fit(X, Y, shuffle=False, **kwargs)


def _dataset(x=X, y=Y, batch=5):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


FIT = {
    "batch_size": _fit(batch_size=4),
    "epochs": _fit(epochs=3),
    "initial_epoch": _fit(epochs=3, initial_epoch=1),
    "steps_per_epoch": _fit(epochs=2, steps_per_epoch=2),
    "validation_split": _fit(epochs=2, validation_split=0.3),
    "validation_data": _fit(epochs=2, validation_data=(XV, YV)),
    "validation_data_weighted": _fit(
        validation_data=(XV, YV, np.linspace(0.5, 1.5, 7, dtype="float32"))),
    "validation_steps": _fit(epochs=2,
                             validation_data=_dataset(XV, YV, 3).repeat(),
                             validation_steps=2),
    "validation_freq": _fit(epochs=3, validation_data=(XV, YV),
                            validation_freq=2),
    "class_weight": _fit(epochs=2, class_weight=CLASS_WEIGHT),
    "sample_weight": _fit(epochs=2, sample_weight=W),
    "shuffle_false": _fit(epochs=2),
    "shuffle_true": lambda m: m.fit(X, Y, batch_size=5, epochs=2,
                                    shuffle=True, verbose=0),
    "verbose_1": _fit(verbose=1),
    "verbose_2": _fit(verbose=2),
}

EVALUATE = {
    "batch_size": lambda m: m.evaluate(X, Y, batch_size=4, verbose=0),
    "steps": lambda m: m.evaluate(_dataset().repeat(), steps=2, verbose=0),
    "sample_weight": lambda m: m.evaluate(X, Y, sample_weight=W,
                                          batch_size=5, verbose=0),
    "return_dict": lambda m: m.evaluate(X, Y, return_dict=True, verbose=0),
}

PREDICT = {
    "batch_size": lambda m: m.predict(X, batch_size=4, verbose=0),
    "steps": lambda m: m.predict(tf.data.Dataset.from_tensor_slices(
        X).batch(5).repeat(), steps=2, verbose=0),
}

ON_BATCH = {
    "train": lambda m: m.train_on_batch(X, Y),
    "train_sample_weight": lambda m: m.train_on_batch(X, Y,
                                                      sample_weight=W),
    "train_class_weight": lambda m: m.train_on_batch(
        X, Y, class_weight=CLASS_WEIGHT),
    "train_return_dict": lambda m: m.train_on_batch(X, Y, return_dict=True),
    "test": lambda m: m.test_on_batch(X, Y),
    "test_sample_weight": lambda m: m.test_on_batch(X, Y, sample_weight=W),
    "test_return_dict": lambda m: m.test_on_batch(X, Y, return_dict=True),
    "predict": lambda m: m.predict_on_batch(X),
}


@pytest.mark.parametrize("argument", sorted(FIT))
def test_fit(cpus, pairs, argument):
    _pair(pairs, "classifier", cpus).run(FIT[argument])


@pytest.mark.parametrize("argument", sorted(EVALUATE))
def test_evaluate(cpus, pairs, argument):
    _pair(pairs, "classifier", cpus).run(EVALUATE[argument])


@pytest.mark.parametrize("argument", sorted(PREDICT))
def test_predict(cpus, pairs, argument):
    _pair(pairs, "classifier", cpus).run(PREDICT[argument])


@pytest.mark.parametrize("call", sorted(ON_BATCH))
def test_on_batch(cpus, pairs, call):
    _pair(pairs, "classifier", cpus).run(ON_BATCH[call])


# -- input kinds: fit (2 epochs), evaluate, predict ----------------------

def _three(x, y, predict_x, batch_size=5, **fit_kwargs):
    """fit, evaluate and predict of one input kind."""
    def call(model):
        return [model.fit(x, y, epochs=2, batch_size=batch_size,
                          shuffle=False, verbose=0, **fit_kwargs),
                model.evaluate(x, y, batch_size=batch_size, verbose=0),
                model.predict(predict_x, batch_size=batch_size, verbose=0)]
    return call


def _generator(with_y=True, forever=False):
    while True:
        for start in range(0, ROWS, 5):
            rows = slice(start, start + 5)
            yield (X[rows], Y[rows]) if with_y else (X[rows],)
        if not forever:
            return


class Batches(keras.utils.PyDataset):
    def __init__(self, with_y=True):
        super().__init__()
        self.with_y = with_y

    def __len__(self):
        return 3

    def __getitem__(self, index):
        rows = slice(index * 5, index * 5 + 5)
        return (X[rows], Y[rows]) if self.with_y else X[rows]


def _generator_calls(model):
    return [model.fit(_generator(forever=True), steps_per_epoch=3,
                      epochs=2, verbose=0),
            model.evaluate(_generator(), verbose=0),
            model.predict(_generator(with_y=False), verbose=0)]


def _pydataset_calls(model):
    return [model.fit(Batches(), epochs=2, verbose=0),
            model.evaluate(Batches(), verbose=0),
            model.predict(Batches(with_y=False), verbose=0)]


def _dataset_calls(model):
    return [model.fit(_dataset(), epochs=2, verbose=0),
            model.evaluate(_dataset(), verbose=0),
            model.predict(_dataset(X, Y).map(lambda x, y: x), verbose=0)]


KINDS = {
    "numpy": ("classifier", _three(X, Y, X)),
    "dataset": ("classifier", _dataset_calls),
    "generator": ("classifier", _generator_calls),
    "pydataset": ("classifier", _pydataset_calls),
    "dict": ("dict", _three({"a": X, "b": XB}, Y3, {"a": X, "b": XB})),
    "list": ("list", _three([X, XB], Y3, [X, XB])),
    "ragged": ("ragged", _three(RAGGED_X, RAGGED_Y, RAGGED_X, 4)),
    "sparse": ("sparse", _three(SPARSE_X, Y3, SPARSE_X)),
    "none_optional": ("optional", _three({"x": X, "o": None}, Y3,
                                         {"x": X, "o": None})),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_input_kind(cpus, pairs, kind):
    name, call = KINDS[kind]
    _pair(pairs, name, cpus).run(call)


# -- what the model's code and a callback see ----------------------------

class Counting(keras.Model):
    """Counts its forward passes in a scalar variable."""

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(3)
        self.calls = self.add_variable(shape=(), initializer="zeros",
                                       trainable=False)

    def call(self, x):
        self.calls.assign_add(1.0)
        return self.dense(x)


class ReadsScalars(keras.callbacks.Callback):
    """Reads scalar variables with `int()` and `float()` after each batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([int(self.model.calls),
                          int(self.model.optimizer.iterations),
                          float(self.model.optimizer.learning_rate)])


def _counting_fit(reader_class):
    def call(model):
        reader = reader_class()
        history = model.fit(X, Y3, batch_size=5, epochs=2, shuffle=False,
                            verbose=0, callbacks=[reader])
        return [history, reader.seen]
    return call


def _counting():
    model = Counting()
    model.compile(optimizer="sgd", loss="mse")
    return model


class ReadsCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(keras.ops.convert_to_numpy(self.model.calls))


def test_unbuilt_model_runs_only_in_steps(cpus):
    """An unbuilt model is built without running its `call` (Keras builds
    it symbolically): its forward-pass counter counts the steps only."""
    plain, expected, mirrored, got = parity.both(
        _counting, _counting_fit(ReadsCounter), cpus)
    parity.assert_same(plain, expected, mirrored, got)
    assert [float(c) for c in got[1]] == [1, 2, 3, 4, 5, 6]


def test_callback_converts_scalar_variables(cpus):
    """`int(variable)` and `float(variable)` work in a callback during
    `fit`, as in plain Keras (a distributed variable has no `__int__`)."""
    plain, expected, mirrored, got = parity.both(
        _counting, _counting_fit(ReadsScalars), cpus)
    parity.assert_same(plain, expected, mirrored, got)
