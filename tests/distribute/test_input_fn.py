"""What virtual shards are cut from, refused by name before any step.

The tests of `keras_mirror/distribute/_input_fn.py`: an `input_fn` that
does not take one argument, shards that yield different structures,
dtypes or shapes (TensorFlow failed deep in the pipeline's `concat`), or
tensors without a batch dimension; and a function (or None, or a number)
given as `x` where no virtual shards read it.
"""

import re
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror import MirroredModel
from keras_mirror.distribute import _input_fn
from keras_mirror.distribute import _virtual_shards
from keras_mirror.wrapper import _validate

X = np.ones((8, 3), "float32")
Y = np.ones((8, 1), "float32")


def _model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def _mirrored(cpus, **kwargs):
    kwargs.setdefault("worker_input", "shard")
    kwargs.setdefault("virtual_shards", 2)
    mirrored = MirroredModel(_model(), devices=cpus[:2], **kwargs)
    mirrored.compile(optimizer="sgd", loss="mse")
    return mirrored


def _shard(*parts, batch=2):
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch)


def good(input_context):
    return _shard(X, Y, batch=input_context.get_per_replica_batch_size(4))


def _per_shard(first, other):
    """An input_fn whose virtual shard 0 is `first()`, the others
    `other()`."""
    return lambda ctx: first() if ctx.input_pipeline_id == 0 else other()


def _refused(cpus, x, message, **kwargs):
    mirrored = _mirrored(cpus, **kwargs)
    with pytest.raises(ValueError, match=message):
        mirrored.fit(x, epochs=1, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 0


_SIGNATURE = re.escape(
    "`input_fn` must take one argument, its virtual shard's "
    "`tf.distribute.InputContext` (`def input_fn(input_context): ...`), and "
    "return that shard's `tf.data.Dataset`. Received: input_fn=")


@pytest.mark.parametrize("fn, shown", [
    (lambda: good(None), "<lambda>()"),
    (lambda a, b: good(a), "<lambda>(a, b)"),
    (lambda *, ctx: good(ctx), "<lambda>(*, ctx)"),
])
def test_input_fn_must_take_one_argument(cpus, fn, shown):
    _refused(cpus, fn, _SIGNATURE + re.escape(shown) + "$")


class _Callable:
    def __call__(self, input_context):
        return good(input_context)


def test_one_argument_in_any_form_is_accepted():
    for fn in (good, lambda *args: None, lambda a, b=1: None,
               lambda a, **kw: None, _Callable()):
        _input_fn.check_signature(fn)
    _input_fn.check_signature(print)  # a builtin: no signature to check


_MISMATCH = re.escape(
    "`input_fn` must give every virtual shard the same structure, dtypes "
    "and shapes (the batch size aside): their batches are concatenated "
    "into each global batch. Received: virtual shard 1 yields ")


@pytest.mark.parametrize("other, shown", [
    (lambda: _shard(X.astype("float64"), Y.astype("float64")),
     "(float64 (None, 3), float64 (None, 1))"),
    (lambda: _shard(np.ones((8, 4), "float32"), Y),
     "(float32 (None, 4), float32 (None, 1))"),
    (lambda: _shard(X, np.ones((8, 2), "float32")),
     "(float32 (None, 3), float32 (None, 2))"),
    (lambda: _shard(X, Y, np.ones(8, "float32")),
     "(float32 (None, 3), float32 (None, 1), float32 (None,))"),
    (lambda: _shard({"a": X}, Y), "({a: float32 (None, 3)}, "
     "float32 (None, 1))"),
])
def test_shards_of_other_dtypes_shapes_or_structures_are_refused(
        cpus, other, shown):
    fn = _per_shard(lambda: _shard(X, Y), other)
    _refused(cpus, fn, _MISMATCH + re.escape(
        f"{shown}, virtual shard 0 yields (float32 (None, 3), "
        "float32 (None, 1))"))


def test_a_batch_size_that_differs_between_shards_is_accepted(cpus):
    fn = _per_shard(
        lambda: _shard(X, Y).rebatch(2, drop_remainder=True),
        lambda: _shard(X, Y, batch=3))
    mirrored = _mirrored(cpus)
    mirrored.fit(fn, epochs=1, verbose=0)
    # 4 batches (shard 0's), and the one more iteration Keras counts at the
    # end of an input of unknown length (see test_virtual_shards.py).
    assert int(mirrored.optimizer.iterations.numpy()) == 5


def test_elements_without_a_batch_dimension_are_refused(cpus):
    fn = lambda ctx: tf.data.Dataset.from_tensors(  # noqa: E731
        (tf.constant(1.0), tf.constant(1.0)))
    _refused(cpus, fn, re.escape(
        "`input_fn` must give batches: every tensor of a virtual shard's "
        "elements needs a batch dimension first (end the pipeline with "
        "`batch(...)`). Received: virtual shard 0 yields (float32 (), "
        "float32 ())"))


def test_another_workers_shards_are_checked_too():
    # Worker 0 of 2 hosts virtual shard 0 only; shard 1, worker 1's, is
    # made (never read) and its spec compared: both workers refuse it.
    worker = types.SimpleNamespace(
        virtual_shards=2, num_workers=2, local_replica_ids=(0,),
        devices=("/cpu:0",))
    made = []

    def fn(ctx):
        made.append(ctx.input_pipeline_id)
        dtype = "float32" if ctx.input_pipeline_id == 0 else "float64"
        return _shard(X.astype(dtype), Y.astype(dtype))

    with pytest.raises(ValueError, match=_MISMATCH):
        _virtual_shards.fit_dataset(worker, fn)
    assert made == [0, 1]


_NOT_READ = re.escape(
    "`x` must be arrays, a `tf.data.Dataset`, a `keras.utils.PyDataset` or "
    "a generator. A function (`input_fn(input_context)`) is read only by "
    "`fit` with `worker_input='shard'`, in virtual shards; here pass its "
    "dataset, e.g. `input_fn(tf.distribute.InputContext())`. "
    "Received: x=good")


@pytest.mark.parametrize("call", [
    lambda m: m.fit(good, epochs=1, verbose=0),
    lambda m: m.evaluate(good, verbose=0),
    lambda m: m.predict(good, verbose=0),
    lambda m: m.train_on_batch(good),
    lambda m: m.verify(good, steps=1),
], ids=["fit", "evaluate", "predict", "train_on_batch", "verify"])
def test_a_function_where_no_virtual_shards_read_it(cpus, call):
    mirrored = _mirrored(cpus, worker_input="replicate", virtual_shards=None)
    with pytest.raises(ValueError, match=_NOT_READ):
        call(mirrored)
    assert int(mirrored.optimizer.iterations.numpy()) == 0


def test_evaluate_and_predict_refuse_an_input_fn_in_shard_mode(cpus):
    mirrored = _mirrored(cpus)
    for call in (mirrored.evaluate, mirrored.predict):
        with pytest.raises(ValueError, match=_NOT_READ):
            call(good, verbose=0)


@pytest.mark.parametrize("value", [5, 2.5, True, np.int64(5),
                                   np.bool_(False)])
def test_a_number_as_x(cpus, value):
    """(`x=None` gets Keras's own error: `test_keras_inputs.py`.)"""
    mirrored = _mirrored(cpus, worker_input="replicate", virtual_shards=None)
    with pytest.raises(ValueError, match=re.escape(
            "`x` must be arrays, a `tf.data.Dataset`, a "
            "`keras.utils.PyDataset` or a generator. "
            f"Received: x={value!r}")):
        mirrored.fit(value, Y, epochs=1, verbose=0)


def test_check_input_passes_what_keras_reads():
    for value in (X, [X, X], {"a": X}, tf.constant(X), _shard(X, Y),
                  iter([X])):
        _validate.check_input("x", value)


def test_describe_shows_dtypes_and_shapes():
    spec = (tf.TensorSpec((None, 3), tf.float32),
            {"b": tf.TensorSpec(None, tf.int64)},
            tf.RaggedTensorSpec((None, None), tf.float32))
    assert _input_fn.describe(spec) == (
        "(float32 (None, 3), {b: int64 (unknown rank)}, RaggedTensorSpec)")


_HINT = re.escape(
    "must not hold `.shard(tf.data.experimental.SHARD_HINT, "
    "tf.data.experimental.SHARD_HINT)` here: only the `x` of `fit` with "
    "`worker_input='shard'` reads it (cut into virtual shards), and "
    "TensorFlow refuses it anywhere else. Remove that `shard`, or pass "
    "`worker_input='shard'` to `MirroredModel`. Received: ")


def _hinted():
    hint = tf.data.experimental.SHARD_HINT
    return tf.data.Dataset.from_tensor_slices((X, Y)).shard(hint, hint).batch(
        4)


@pytest.mark.parametrize("name, call", [
    ("x", lambda m: m.fit(_hinted(), verbose=0)),
    # It failed after a whole epoch of training.
    ("validation_data", lambda m: m.fit(X, Y, validation_data=_hinted(),
                                        verbose=0)),
    ("x", lambda m: m.evaluate(_hinted(), verbose=0)),
    ("x", lambda m: m.predict(_hinted().map(lambda a, b: a), verbose=0)),
    ("x", lambda m: m.verify(_hinted(), steps=1)),
], ids=["fit", "validation_data", "evaluate", "predict", "verify"])
def test_a_shard_hint_where_no_virtual_shards_read_it(cpus, name, call):
    mirrored = _mirrored(cpus, worker_input="replicate", virtual_shards=None)
    with pytest.raises(ValueError, match=f"`{name}` " + _HINT + re.escape(
            f"{name} with `shard(SHARD_HINT, SHARD_HINT)`")):
        call(mirrored)
    assert int(mirrored.optimizer.iterations.numpy()) == 0


def test_a_shard_hint_as_validation_data_in_shard_mode(cpus):
    mirrored = _mirrored(cpus)
    with pytest.raises(ValueError, match="`validation_data` " + _HINT):
        mirrored.fit(_hinted(), validation_data=_hinted(), verbose=0)
    mirrored.fit(_hinted(), validation_data=_shard(X, Y), verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) > 0
