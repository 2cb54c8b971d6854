"""`MirroredModel` reads its input exactly as plain Keras does (issues 24, 25).

A TFRecord pipeline whose `map` counts every record it parses (a
`tf.py_function`): `fit` over 2 epochs, `fit` with `validation_data`,
`evaluate` and `predict` read as many records through the wrapper as on one
device, on both execution paths. Reading ahead (a check that the dataset is
not empty, a batch to build or probe the loss from) would read more.

Then every input kind, in both batch modes and with `worker_input="shard"`,
counted element by element: `fit`'s input is prepared in one pass
(`wrapper/_fit_input.py`), which reads a first element at most once
(`keras_mirror/wrapper/_first.py`), only where the input's spec cannot say
what is needed, and shares it. The read
path does not depend on the execution path (the pass runs before the step),
so these run on the default one.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror

RECORDS, BATCH = 96, 16


class Counter:
    def __init__(self):
        self.count = 0

    def bump(self, record):
        self.count += 1
        return record


@pytest.fixture
def records(tmp_path):
    path = str(tmp_path / "rows.tfrecord")
    rng = np.random.default_rng(0)
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(RECORDS):
            features = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(
                    value=rng.normal(size=6).tolist())),
                "y": tf.train.Feature(float_list=tf.train.FloatList(
                    value=[float(i % 3)]))}
            writer.write(tf.train.Example(features=tf.train.Features(
                feature=features)).SerializeToString())
    return path


def _dataset(path, counter, padded=False):
    def parse(record):
        record = tf.py_function(counter.bump, [record], tf.string)
        example = tf.io.parse_single_example(record, {
            "x": tf.io.FixedLenFeature([6], tf.float32),
            "y": tf.io.FixedLenFeature([1], tf.float32)})
        return example["x"], example["y"]

    dataset = tf.data.TFRecordDataset(path).map(parse)
    if padded:  # open inner dimensions: the spec alone gives no zeros
        return dataset.padded_batch(BATCH, padded_shapes=([None], [1]))
    return dataset.batch(BATCH)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _reads(model, path, padded=False):
    counter = Counter()

    def ds():
        return _dataset(path, counter, padded)

    calls = {
        "fit": lambda: model.fit(ds(), epochs=2, verbose=0),
        "fit_validation": lambda: model.fit(ds(), epochs=2, verbose=0,
                                            validation_data=ds()),
        "evaluate": lambda: model.evaluate(ds(), verbose=0),
        "predict": lambda: model.predict(ds().map(lambda x, y: x),
                                         verbose=0),
    }
    reads = {}
    for name, call in calls.items():
        counter.count = 0
        call()
        reads[name] = counter.count
    return reads


@pytest.mark.usefixtures("execution")
def test_fit_evaluate_predict_read_each_record_as_keras_does(records):
    expected = _reads(_model(), records)
    assert expected == {"fit": 2 * RECORDS, "fit_validation": 4 * RECORDS,
                        "evaluate": RECORDS, "predict": RECORDS}
    assert _reads(keras_mirror.MirroredModel(_model()), records) == expected


@pytest.mark.usefixtures("execution")
def test_a_dataset_with_open_shapes_is_not_read_ahead(records):
    """`padded_batch`: the element spec has no static inner shape."""
    expected = _reads(_model(), records, padded=True)
    mirrored = keras_mirror.MirroredModel(_model())
    assert _reads(mirrored, records, padded=True) == expected
    assert expected["fit"] == 2 * RECORDS


@pytest.mark.usefixtures("execution")
def test_the_weights_match_one_device(records):
    single, wrapped = _model(), _model()
    mirrored = keras_mirror.MirroredModel(wrapped)
    counter = Counter()
    single.fit(_dataset(records, counter), epochs=2, verbose=0)
    mirrored.fit(_dataset(records, counter), epochs=2, verbose=0)
    for a, b in zip(single.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


# -- every input kind, counted per element (issue 25: one pass) -----------
#
# Each input below counts the elements (batches) read from it. Plain Keras
# reads each element once per epoch (a `PyDataset` also items 0 and 1 once
# more, for its spec); the wrapper's one pass over `fit`'s input
# (`wrapper/_fit_input.py`) reads a first element at most once, and only
# where nothing else says what it needs (stated per case), so a second read
# anywhere fails these counts.

ROWS, STEP_ROWS, EPOCHS = 64, 8, 2
ELEMENTS = ROWS // STEP_ROWS  # 8: a multiple of the 4 replicas
_RNG = np.random.default_rng(1)
X = _RNG.normal(size=(ROWS, 6)).astype("float32")
Y = _RNG.normal(size=(ROWS, 1)).astype("float32")


class CountedArray(np.ndarray):
    """An array that records every index it is read at."""

    reads = []

    def __getitem__(self, key):
        CountedArray.reads.append(repr(key))
        return super().__getitem__(key)


def _counted_dataset(kind, counter):
    """A dataset of `ELEMENTS` batches that counts each one read."""
    rows = tf.data.Dataset.from_tensor_slices((X, Y))
    if kind == "static":  # known inner shapes, dynamic batch size
        dataset = rows.batch(STEP_ROWS)
    elif kind == "static_batch":  # `drop_remainder`: the batch size too
        dataset = rows.batch(STEP_ROWS, drop_remainder=True)
    else:  # "dynamic": open inner shapes
        dataset = rows.padded_batch(STEP_ROWS, padded_shapes=([None], [1]))

    def count(x, y):
        with tf.control_dependencies([tf.py_function(
                lambda: counter.bump(0), [], tf.int32)]):
            return tf.identity(x), tf.identity(y)

    return dataset.map(count)


class CountedPyDataset(keras.utils.PyDataset):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __len__(self):
        return ELEMENTS

    def __getitem__(self, index):
        self.reads.append(index)
        rows = slice(index * STEP_ROWS, (index + 1) * STEP_ROWS)
        return X[rows], Y[rows]


def _generator(reads):
    for index in range(ELEMENTS):
        reads.append(index)
        rows = slice(index * STEP_ROWS, (index + 1) * STEP_ROWS)
        yield X[rows], Y[rows]


def _small(built=True):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,))] if built else []
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _fit_reads(model, kind, epochs=EPOCHS):
    """What `model.fit` reads of an input of `kind`: a count, or the
    indices read (arrays, `PyDataset`, generator)."""
    if kind == "arrays":
        CountedArray.reads = []
        model.fit(X.view(CountedArray), Y, batch_size=STEP_ROWS,
                  epochs=epochs, verbose=0, shuffle=False)
        return list(CountedArray.reads)
    if kind in ("pydataset", "generator"):
        reads = []
        x = CountedPyDataset(reads) if kind == "pydataset" \
            else _generator(reads)
        model.fit(x, epochs=1 if kind == "generator" else epochs, verbose=0)
        return sorted(reads)
    counter = Counter()
    model.fit(_counted_dataset(kind, counter), epochs=epochs, verbose=0)
    return counter.count


def _wrap(model, batch="global"):
    return keras_mirror.MirroredModel(model, batch=batch)


@pytest.mark.parametrize("kind", ["arrays", "static", "static_batch",
                                  "dynamic", "generator"])
def test_global_batches_are_read_as_keras_reads_them(kind):
    """Arrays, datasets of static and dynamic shapes, generators: nothing
    read ahead (a built model's loss and metrics build from shapes; a
    generator's first element is peeked once and trained on)."""
    expected = _fit_reads(_small(), kind)
    assert _fit_reads(_wrap(_small()), kind) == expected
    if kind in ("static", "static_batch", "dynamic"):
        assert expected == EPOCHS * ELEMENTS
    if kind == "generator":
        assert expected == list(range(ELEMENTS))


def test_an_unbuilt_model_reads_one_row_of_arrays_to_build():
    expected = _fit_reads(_small(built=False), "arrays")
    got = _fit_reads(_wrap(_small(built=False)), "arrays")
    assert got == [repr(slice(None, 1))] + expected


def test_a_pydataset_item_0_is_read_once_for_build_and_probe():
    """A `PyDataset` has no spec: item 0 builds the model and classifies the
    loss, once; Keras itself reads items 0 and 1 once more for its spec."""
    expected = _fit_reads(_small(), "pydataset")
    assert expected == sorted(list(range(ELEMENTS)) * EPOCHS + [0, 1])
    assert _fit_reads(_wrap(_small()), "pydataset") == sorted(expected + [0])


@pytest.mark.parametrize("kind, ahead", [
    ("static_batch", 0),  # the capacity is the spec's batch size
    ("static", 1),  # the capacity is the first element's rows
    ("dynamic", 1),  # ... and it also builds and is checked
])
def test_per_replica_datasets_read_the_first_element_at_most_once(
        kind, ahead):
    """`batch="per_replica"`: the capacity, the build, the checks and the
    probe share one read of the first element (before issue 25, a
    `padded_batch` input was read 14 elements ahead)."""
    got = _fit_reads(_wrap(_small(), "per_replica"), kind)
    assert got == EPOCHS * ELEMENTS + ahead


def test_per_replica_generator_and_pydataset_read_nothing_twice():
    """A generator is peeked once; a `PyDataset`'s item 0, read for the
    capacity and the build, is handed to the first read of the joined
    item 0, so each item is read once per epoch plus Keras's own spec
    reads (joined items 0 and 1: items 0 to 7)."""
    got = _fit_reads(_wrap(_small(), "per_replica"), "generator")
    assert got == list(range(ELEMENTS))
    got = _fit_reads(_wrap(_small(), "per_replica"), "pydataset")
    assert got == sorted(list(range(ELEMENTS)) * (EPOCHS + 1))


def test_worker_shards_read_each_record_once_per_epoch(records):
    """`worker_input="shard"` (virtual shards, one process) reads each
    record once per epoch, as plain Keras's `fit` does: no counting pass
    before training (the workers agree on an epoch's end as they go)."""
    plain = Counter()
    _model().fit(_dataset(records, plain), epochs=2, verbose=0)
    counter = Counter()
    mirrored = keras_mirror.MirroredModel(_model(), worker_input="shard",
                                          virtual_shards=1)
    mirrored.fit(_dataset(records, counter), epochs=2, verbose=0)
    assert plain.count == 2 * RECORDS
    assert counter.count == plain.count


def test_worker_rows_of_arrays_are_read_once_per_epoch():
    """`worker_input="shard"` on arrays: each worker slices only its
    segments of each global batch, once per epoch."""
    from support.multi_worker import worker_stub

    from keras_mirror.distribute import _worker_input

    x = X[:45].view(CountedArray)
    dataset, _, _, _ = _worker_input.shard_fit_input(
        worker_stub(0), x, Y[:45], 8, {"shuffle": False})
    CountedArray.reads = []
    for _ in range(EPOCHS):
        for _ in dataset:
            pass
    bounds = _worker_input.segments(worker_stub(0), 45, 8)
    assert CountedArray.reads == [repr(slice(a, b)) for a, b in bounds] * 2
