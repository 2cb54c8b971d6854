"""The same call through plain Keras and through `MirroredModel`, compared.

`both` builds a model twice from one seed, makes the call on the plain
model (one device) and on the wrapped one (the replicas), each from one
seed too, and returns both results; `assert_same` compares them leaf by
leaf: `History` objects by their keys and values, arrays and numbers within
`atol`, and the two models' weights.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_mirror

ATOL = 1e-5


def both(build, call, cpus, **wrap_kwargs):
    """`(plain model, its result, mirrored model, its result)`.

    `build()` returns a compiled model; `call(model)` makes the call.
    """
    keras.utils.set_random_seed(0)
    plain = build()
    keras.utils.set_random_seed(1)
    expected = call(plain)
    keras.utils.set_random_seed(0)
    mirrored = keras_mirror.MirroredModel(build(), devices=cpus,
                                          **wrap_kwargs)
    keras.utils.set_random_seed(1)
    got = call(mirrored)
    return plain, expected, mirrored, got


def _plain(value):
    """A comparable form of a result: History -> its dict, tensors ->
    NumPy arrays (ragged and sparse ones by their dense values)."""
    if isinstance(value, keras.callbacks.History):
        return _plain(value.history)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, tf.RaggedTensor):
        return value.to_tensor().numpy()
    if isinstance(value, tf.SparseTensor):
        return tf.sparse.to_dense(value).numpy()
    if value is None:
        return None
    return np.asarray(value)


def assert_close(expected, got, atol=ATOL, where="result"):
    """`expected` and `got` have one structure and close values."""
    expected, got = _plain(expected), _plain(got)
    if isinstance(expected, dict):
        assert isinstance(got, dict), (where, expected, got)
        assert sorted(expected) == sorted(got), (where, expected, got)
        for key in expected:
            assert_close(expected[key], got[key], atol, f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(got, list) and len(got) == len(expected), (
            where, expected, got)
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_close(e, g, atol, f"{where}[{i}]")
    elif expected is None:
        assert got is None, (where, got)
    else:
        assert np.shape(expected) == np.shape(got), (where, expected, got)
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol,
                                   err_msg=where)


def assert_same(plain, expected, mirrored, got, atol=ATOL):
    """The results and the two models' weights are equal within `atol`."""
    assert_close(expected, got, atol)
    assert_close(plain.get_weights(), mirrored.model.get_weights(), atol,
                 "weights")


def error_of(call):
    """`(class, message)` of the exception `call()` raises."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any class is compared
        return type(e), str(e)
    raise AssertionError("no exception was raised")


class Pair:
    """A plain model and the same model wrapped, shared by many calls.

    Both are built by `build()` from one seed (and called once on `sample`
    when given, for a subclassed model that builds on its first call);
    `run(call)` puts both back on the initial weights (SGD keeps no other
    state), makes the call on each from one seed and asserts the results
    and weights equal. Built once per test module: the wrapper's steps are
    traced once for all its calls.
    """

    def __init__(self, build, cpus, sample=None, **wrap_kwargs):
        models = []
        for _ in range(2):
            keras.utils.set_random_seed(0)
            model = build()
            if sample is not None:
                model(sample)
            models.append(model)
        self.plain = models[0]
        self.mirrored = keras_mirror.MirroredModel(models[1], devices=cpus,
                                                   **wrap_kwargs)
        self._initial = self.plain.get_weights()

    def _reset(self):
        for model in (self.plain, self.mirrored.model):
            model.set_weights(self._initial)
            model.optimizer.iterations.assign(0)

    def run(self, call, atol=ATOL):
        """`call(model)` on both models; returns the two results."""
        self._reset()
        results = []
        for model in (self.plain, self.mirrored):
            keras.utils.set_random_seed(1)
            results.append(call(model))
        assert_same(self.plain, results[0], self.mirrored, results[1], atol)
        return results
