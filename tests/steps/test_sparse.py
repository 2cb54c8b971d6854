"""Issue 23, item 10: a `tf.sparse.SparseTensor` input trains exactly.

Plain Keras trains on a sparse input (`keras.Input(sparse=True)`); the
steps cut it into the replicas' shards with `tf.sparse.slice`
(`steps/_rows.py`). Uneven and empty shards included, the weights equal
single-device training within 1e-5 on both execution paths, and
`evaluate` and `predict` agree with plain Keras.

Also the tests of `keras_mirror/steps/_rows.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import max_diff
from support.helpers import once

import keras_mirror

pytestmark = pytest.mark.usefixtures("execution")


def _data(rows):
    rng = np.random.default_rng(3)
    dense = rng.normal(size=(rows, 6)).astype("float32")
    dense[rng.uniform(size=dense.shape) > 0.4] = 0.0
    y = rng.normal(size=(rows, 1)).astype("float32")
    return tf.sparse.from_dense(dense), y


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), sparse=True),
        keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


# Empty shards (11 rows in 3s: 1/1/1/0, then 1/1/0/0), one whole batch
# (3/3/2/2) and a last row alone (1/0/0/0).
@pytest.mark.parametrize("execution,rows,batch_size", [
    ("strategy", 11, 3), ("strategy", 10, 10),
    ("strategy", 9, 2)], indirect=["execution"])
def test_sparse_arrays_train_as_on_one_device(cpus, execution, rows,
                                              batch_size, one_device):
    x, y = _data(rows)

    def reference():
        model = _model()
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
                  verbose=0)
        return (model.get_weights(), float(model.evaluate(x, y, verbose=0)),
                model.predict(x, verbose=0))

    weights, evaluated, predicted = once(one_device, (rows, batch_size),
                                         reference)
    model = _model()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
                 verbose=0)
    assert max_diff(weights, model.get_weights()) < 1e-5
    assert float(mirrored.evaluate(x, y, verbose=0)) == pytest.approx(
        evaluated, abs=1e-5)
    np.testing.assert_allclose(mirrored.predict(x, verbose=0), predicted,
                               atol=1e-5)


def test_sparse_dataset_trains_as_on_one_device(cpus):
    x, y = _data(10)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    reference = _model()
    reference.fit(dataset, epochs=2, verbose=0)
    model = _model()
    keras_mirror.MirroredModel(model, devices=cpus).fit(dataset, epochs=2,
                                                        verbose=0)
    assert max_diff(reference.get_weights(), model.get_weights()) < 1e-5


class _Crash(Exception):
    pass


class _CrashAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            raise _Crash()


# The backup and resume are the paths' shared code (`StepBackup`); the
# sparse shards of both paths are trained above.
@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_sparse_arrays_resume_mid_epoch_from_a_step_backup(cpus, execution,
                                                           tmp_path):
    x, y = _data(11)
    kwargs = dict(batch_size=3, epochs=2, shuffle=False, verbose=0,
                  validation_split=0.2)
    reference = _model()
    reference.fit(x, y, **kwargs)
    model = _model()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    with pytest.raises(_Crash):
        mirrored.fit(x, y, callbacks=[keras_mirror.StepBackup(tmp_path),
                                      _CrashAfter(2)], **kwargs)
    resumed = keras_mirror.MirroredModel(_model(), devices=cpus)
    resumed.fit(x, y, callbacks=[keras_mirror.StepBackup(tmp_path)],
                **kwargs)
    assert int(resumed.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy())
    assert max_diff(reference.get_weights(),
                    resumed.model.get_weights()) < 1e-5
