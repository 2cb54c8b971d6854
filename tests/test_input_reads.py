"""`MirroredModel` reads its input exactly as plain Keras does (issue 24).

A TFRecord pipeline whose `map` counts every record it parses (a
`tf.py_function`): `fit` over 2 epochs, `fit` with `validation_data`,
`evaluate` and `predict` read as many records through the wrapper as on one
device, on both execution paths. Reading ahead (a check that the dataset is
not empty, a batch to build or probe the loss from) would read more.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror

pytestmark = pytest.mark.usefixtures("execution")

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


def test_fit_evaluate_predict_read_each_record_as_keras_does(records):
    expected = _reads(_model(), records)
    assert expected == {"fit": 2 * RECORDS, "fit_validation": 4 * RECORDS,
                        "evaluate": RECORDS, "predict": RECORDS}
    assert _reads(keras_mirror.MirroredModel(_model()), records) == expected


def test_a_dataset_with_open_shapes_is_not_read_ahead(records):
    """`padded_batch`: the element spec has no static inner shape."""
    expected = _reads(_model(), records, padded=True)
    mirrored = keras_mirror.MirroredModel(_model())
    assert _reads(mirrored, records, padded=True) == expected
    assert expected["fit"] == 2 * RECORDS


def test_the_weights_match_one_device(records):
    single, wrapped = _model(), _model()
    mirrored = keras_mirror.MirroredModel(wrapped)
    counter = Counter()
    single.fit(_dataset(records, counter), epochs=2, verbose=0)
    mirrored.fit(_dataset(records, counter), epochs=2, verbose=0)
    for a, b in zip(single.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
