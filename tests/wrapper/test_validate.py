"""Issue 23: every bad input refused before a step runs, and every refusal
leaves the model untouched.

`REFUSALS` are mistakes made on a `MirroredModel` that has already trained
(so its optimizer has slots), one wrapper per kind for all of them. Each
test makes the mistake on it, asserts the exact message (naming the
argument and the value received, as every case of `tests/test_errors.py`),
then that the weights and the optimizer's variables are bit for bit as
before, and that the same wrapper trains a step afterwards.
`tests/test_errors.py` lists them in `docs/errors.md`.

Also the tests of `keras_mirror/wrapper/_contents.py` (the input's
contents against the model: values, rows, targets, input shapes).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import once
from support.refusals import REFUSALS
from support.refusals import X
from support.refusals import Y
from support.refusals import assert_keras_style
from support.refusals import assert_untouched_and_trains
from support.refusals import in_other_strategy
from support.refusals import regressor
from support.refusals import state
from support.refusals import trained

import keras_mirror
from keras_mirror import errors


@pytest.fixture(params=["strategy"])
def path(request):
    return request.param


@pytest.fixture(scope="module")
def wrappers():
    """One trained wrapper per kind, shared by the refusals: each mistake
    is made on a wrapper the mistakes before it left untouched."""
    return {}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusal_leaves_the_model_untouched(cpus, name, monkeypatch,
                                            tmp_path, wrappers):
    monkeypatch.chdir(tmp_path)
    case = REFUSALS[name]
    mirrored, y = once(wrappers, case.kind, lambda: trained(cpus, case.kind))
    before = state(mirrored)
    with pytest.raises(case.error, match=case.match) as info:
        case.make(mirrored, y)
    assert_keras_style(str(info.value), case.argument)
    if not case.untouched:
        before = state(mirrored)
    assert_untouched_and_trains(mirrored, y, before)


@pytest.mark.parametrize("execution", ["strategy"])
def test_other_strategy_scope_on_both_paths(cpus, execution):
    """The wrapper's own nested calls (validation inside `fit`) pass."""
    mirrored = keras_mirror.MirroredModel(regressor(), cpus,
                                          execution=execution)
    mirrored.compile(optimizer="adam", loss="mse")
    mirrored.fit(X, Y, batch_size=8, validation_data=(X, Y), verbose=0)
    before = state(mirrored)
    with pytest.raises(errors.StrategyScopeError):
        in_other_strategy(mirrored, Y)
    assert_untouched_and_trains(mirrored, Y, before)


def test_model_built_under_another_strategy_is_refused(cpus):
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = regressor()
    with pytest.raises(errors.StrategyScopeError, match=(
            r"`model` must be built outside any `tf.distribute` strategy: "
            r"its variable '.*kernel' belongs to a strategy "
            r"\(MirroredVariable\).*Received: model='sequential.*' with "
            r"MirroredVariables")):
        keras_mirror.MirroredModel(model, cpus)


def test_generator_may_vary_what_the_model_leaves_open(cpus):
    """Sequences of varying length fit an input of shape (None, None, 2)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 2)),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(1)])
    mirrored = keras_mirror.MirroredModel(model, cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(_sequences(), verbose=0)
    plain = keras.Sequential([keras.Input((None, 2)),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(1)])
    plain.compile(optimizer="sgd", loss="mse")
    plain.fit(_sequences(), verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == int(
        plain.optimizer.iterations.numpy())


def _sequences():
    return ((np.ones((4, t, 2), "float32"), Y[:4]) for t in (3, 5, 2))


def test_per_replica_groups_of_different_shapes_are_named(cpus):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 2)),
                              keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(1)])
    mirrored = keras_mirror.MirroredModel(model, cpus, batch="per_replica")
    mirrored.compile(optimizer="sgd", loss="mse")
    batches = ((np.ones((1, t, 2), "float32"), Y[:1])
               for t in (3, 3, 3, 4))
    with pytest.raises(ValueError, match=(
            r"`batch='per_replica'` joins each group of 4 consecutive "
            r"batches of the generator `x` into one global batch, so they "
            r"must have the same shapes apart from the rows\. Received: a "
            r"group of batches of shapes \[\[\(3, 2\), \(1,\)\], .*"
            r"\[\(4, 2\), \(1,\)\]\]")):
        mirrored.fit(batches, verbose=0)


def test_labels_in_range_and_integer_weights_are_accepted(cpus):
    mirrored, y = trained(cpus, "classifier")
    mirrored.fit(X, y, batch_size=8, sample_weight=np.ones((8, 1)),
                 verbose=0, epochs=2, initial_epoch=2)  # nothing to train
    mirrored.fit(X, y, batch_size=8, verbose=0,
                 class_weight={0: 1, 1: 2.0, 2: np.float32(0.5)})
    assert int(mirrored.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_one_hot_labels_refused_once_the_wrapper_builds_the_model(cpus,
                                                                  method):
    """An unbuilt model built from a dataset's spec: the labels' check
    that needs its outputs runs right after the build, before any step."""
    model = keras.Sequential([keras.layers.Dense(3)])
    mirrored = keras_mirror.MirroredModel(model, cpus)
    mirrored.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.ones((8, 4), "float32")
    one_hot = np.eye(3, dtype="float32")[np.arange(8) % 3]
    dataset = tf.data.Dataset.from_tensor_slices((x, one_hot)).batch(4)
    with pytest.raises(ValueError, match=re.escape(
            "`y` must hold one class index per output position (shape ")
            + r".*" + re.escape(
                "for the loss sparse_categorical_crossentropy; one-hot "
                "targets go with categorical_crossentropy. Received: "
                "y.shape=(1, 3)")):
        getattr(mirrored, method)(dataset, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 0
