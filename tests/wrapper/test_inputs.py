"""`wrapper._inputs`: batches for building, without reading the input."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import data
from support.helpers import max_diff
from support.helpers import mlp

import keras_mirror
from keras_mirror.distribute import _rows
from keras_mirror.wrapper import _first
from keras_mirror.wrapper import _grouping
from keras_mirror.wrapper import _inputs
from keras_mirror.wrapper import _rebuild


def _counting(dataset):
    """`dataset` and a list that grows by one per element read from it."""
    reads = []

    def count(x, y):
        def bump():
            reads.append(1)
            return np.int32(0)

        tf.py_function(bump, [], tf.int32)
        return x, y

    return dataset.map(count), reads


def test_first_batch_comes_from_the_element_spec():
    x, y, _ = data(23)
    dataset, reads = _counting(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(10))
    bx, by, sw = _inputs.first_batch(dataset)
    assert reads == []
    assert bx.shape == (1, 6) and by.shape == (1, 3) and sw is None
    assert bx.dtype == tf.float32 and float(tf.reduce_sum(bx)) == 0.0


def test_open_shapes_fall_back_to_one_element():
    ragged = tf.data.Dataset.from_tensor_slices(
        (tf.ragged.constant([[1.0], [2.0, 3.0]]), [0.0, 1.0])).batch(2)
    assert _inputs.batch_from_spec(ragged) is None
    sequences = tf.data.Dataset.from_generator(
        lambda: iter([(np.ones((2, 5), "float32"), np.ones(2, "float32"))]),
        output_signature=(tf.TensorSpec((None, None), tf.float32),
                          tf.TensorSpec((None,), tf.float32)))
    assert _inputs.batch_from_spec(sequences) is None
    bx, _, _ = _inputs.first_batch(sequences)
    assert bx.shape == (2, 5)  # the real first element


def test_capacity_from_a_static_batch_size():
    x, y, _ = data(24)
    dataset, reads = _counting(tf.data.Dataset.from_tensor_slices(
        (x, y)).batch(6, drop_remainder=True))
    assert _grouping.capacity_of(dataset, _first.First(dataset)) == 6
    assert reads == []


def test_fit_reads_each_element_once_like_plain_keras(cpus):
    x, y, _ = data(23)
    counts = {}
    for name in ("plain", "mirrored"):
        dataset, reads = _counting(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(10))
        model = mlp()
        if name == "mirrored":
            model = keras_mirror.MirroredModel(model, devices=cpus)
        model.compile(optimizer="sgd", loss="mse")
        model.fit(dataset, epochs=2, verbose=0)
        counts[name] = len(reads)
    assert counts == {"plain": 6, "mirrored": 6}


def test_unbuilt_model_builds_from_the_spec(cpus):
    x, y, _ = data(23)
    dataset, reads = _counting(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(10))
    model = keras.Sequential([keras.layers.Dense(3)])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(dataset, epochs=1, verbose=0)
    assert len(reads) == 3
    assert mirrored.model.built


# -- issue 16, defect 7: a generator in batch="per_replica" mode gives N
# consecutive elements to one step, as a dataset or PyDataset does --------

def _elements(count, rows=2):
    x, y, _ = data(count * rows)
    return x, y, [(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
                  for i in range(count)]


def _mirrored(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          batch="per_replica")
    mirrored.compile(optimizer="sgd", loss="mse")
    return mirrored


def test_generator_per_replica_groups_num_replicas_elements(cpus):
    x, y, elements = _elements(8)
    mirrored = _mirrored(cpus)
    mirrored.fit(iter(elements), epochs=1, verbose=0)
    steps = mirrored.replica_history["batch"]
    assert len(steps) == 2
    assert [steps[i]["samples"] for i in (0, 1)] == [[2, 2, 2, 2]] * 2
    # One device, a generator of the two global batches of 8 rows. (Keras
    # counts one more optimizer iteration at the end of an input of
    # unknown length, on one device as here.)
    reference = mlp()
    reference.compile(optimizer="sgd", loss="mse")
    reference.fit(((x[i:i + 8], y[i:i + 8]) for i in (0, 8)), verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == \
        int(reference.optimizer.iterations.numpy())
    assert max_diff(reference.get_weights(),
                    mirrored.model.get_weights()) < 1e-5


def test_generator_per_replica_short_last_group_is_refused(cpus):
    _, _, elements = _elements(6)
    with pytest.raises(Exception, match=(
            r"`batch='per_replica'` needs the number of batches to be a "
            r"multiple of the replica count \(4\): the last group of "
            r"batches is short. Received: a final group of 2 batch\(es\) "
            "from the generator `x`")):
        _mirrored(cpus).fit(iter(elements), epochs=1, verbose=0)


def test_is_strings_reads_every_kind_of_dtype():
    for dtype in ("string", tf.string, np.dtype("<U3"), "<U3", "S2"):
        assert _rebuild.is_strings(dtype), dtype
    for dtype in (None, "float32", tf.float32, np.dtype("float32"), "int64",
                  "bfloat16", np.dtype("O")):
        assert not _rebuild.is_strings(dtype), dtype


def test_strings_for_a_numeric_input_are_refused_before_a_step(cpus):
    # TensorFlow failed in the step: "Cast string to float is not
    # supported".
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    text = np.full((8, 6), "a")
    ds = tf.data.Dataset.from_tensor_slices((text, np.ones((8, 1)))).batch(4)
    for x, y, shown in ((ds, None, "tf.string"), (text, np.ones((8, 1)),
                                                  "dtype('<U1')")):
        with pytest.raises(ValueError, match=(
                r"`x` must hold numbers for the model's input of dtype "
                rf"float32\. Received: x with dtype={re.escape(shown)}")):
            mirrored.fit(x, y, epochs=1, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 0


_ENDLESS = (r"`{steps}` must be given for an endless `{name}` \(a dataset "
            r"repeated forever, `\.repeat\(\)`\): without it the epoch never "
            r"ends\. Pass `{steps}=\.\.\.`, or repeat the dataset a finite "
            r"number of times\. Received: {steps}=None")


@pytest.mark.timeout(120)  # each call ran forever, as in plain Keras 3
def test_an_endless_dataset_needs_its_step_count(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(8)
    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    calls = {
        ("x", "steps_per_epoch"): lambda: mirrored.fit(endless, verbose=0),
        ("validation_data", "validation_steps"): lambda: mirrored.fit(
            x, y, validation_data=endless, verbose=0),
        ("x", "steps"): lambda: mirrored.evaluate(endless, verbose=0),
    }
    for (name, steps), call in calls.items():
        with pytest.raises(ValueError, match=_ENDLESS.format(
                name=name, steps=steps)):
            call()
    with pytest.raises(ValueError, match=_ENDLESS.format(
            name="x", steps="steps")):
        mirrored.predict(endless.map(lambda a, b: a), verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 0
    # With the step counts, all of them run.
    mirrored.fit(endless, steps_per_epoch=3, validation_data=endless,
                 validation_steps=1, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 3
    mirrored.evaluate(endless, steps=2, verbose=0)


def test_refuse_endless_reads_cardinality_only():
    finite = tf.data.Dataset.range(3)
    unknown = finite.filter(lambda v: v > 0)
    for x in (finite, unknown, [finite, unknown], np.zeros(3), None):
        _rows.refuse_endless("x", x, "steps", None)
    with pytest.raises(ValueError, match="Received: steps=None"):
        _rows.refuse_endless("x", [finite, finite.repeat()], "steps",
                               None)
    _rows.refuse_endless("x", finite.repeat(), "steps", 2)
