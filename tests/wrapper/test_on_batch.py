"""`train_on_batch` / `test_on_batch` return what plain Keras returns.

A scalar, a list in Keras's order, or a dict with `return_dict=True`, with
the same values as one device; the per-replica vectors are in
`mirrored.last_replica_logs`. `fit`'s History and the user's callbacks see
plain Keras's keys; only opted-in callbacks see `replica_*` vectors.
"""

import keras
import numpy as np
import pytest
from support.helpers import data
from support.helpers import mlp
from support.helpers import own_step_model

import keras_mirror

# Each test runs on both execution paths (conftest.py); a test of code both
# paths share (the returned logs' form) runs on one of them, named by its
# `parametrize("execution", ..., indirect=True)`.
pytestmark = pytest.mark.usefixtures("execution")


def _pair(cpus, metrics=("mae",)):
    reference = mlp()
    reference.compile(optimizer="sgd", loss="mse", metrics=list(metrics))
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse", metrics=list(metrics))
    return reference, mirrored


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_train_on_batch_unpacks_as_plain_keras(cpus, execution):
    reference, mirrored = _pair(cpus)
    x, y, _ = data(7)
    loss, mae = mirrored.train_on_batch(x, y)
    ref_loss, ref_mae = reference.train_on_batch(x, y)
    assert isinstance(loss, float) and isinstance(mae, float)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert mae == pytest.approx(ref_mae, rel=1e-5)
    loss, mae = mirrored.test_on_batch(x, y)
    ref_loss, ref_mae = reference.test_on_batch(x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert mae == pytest.approx(ref_mae, rel=1e-5)


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_a_model_without_metrics_returns_a_scalar(cpus, execution):
    reference, mirrored = _pair(cpus, metrics=())
    x, y, _ = data(5)
    got = mirrored.train_on_batch(x, y)
    assert isinstance(got, float)
    assert got == pytest.approx(reference.train_on_batch(x, y), rel=1e-5)
    assert isinstance(mirrored.test_on_batch(x, y), float)


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_return_dict_has_plain_keras_keys_and_floats(cpus, execution):
    reference, mirrored = _pair(cpus)
    x, y, sw = data(6)
    got = mirrored.train_on_batch(x, y, sample_weight=sw, return_dict=True)
    ref = reference.train_on_batch(x, y, sample_weight=sw, return_dict=True)
    assert list(got) == list(ref) == ["loss", "mae"]
    line = ", ".join(f"{k}: {v:.4f}" for k, v in got.items())
    assert line == ", ".join(f"{k}: {v:.4f}" for k, v in ref.items())
    got = mirrored.test_on_batch(x, y, return_dict=True)
    assert list(got) == list(reference.test_on_batch(x, y, return_dict=True))


def test_last_replica_logs_hold_the_last_steps_vectors(cpus):
    _, mirrored = _pair(cpus)
    assert mirrored.last_replica_logs == {}
    x, y, sw = data(7)
    mirrored.train_on_batch(x[:6], y[:6])
    mirrored.train_on_batch(x, y, sample_weight=sw)
    logs = mirrored.last_replica_logs
    assert logs["samples"].tolist() == [2, 2, 2, 1]
    np.testing.assert_allclose(
        logs["sample_weight"], [sw[:2].sum(), sw[2:4].sum(), sw[4:6].sum(),
                                sw[6:].sum()], rtol=1e-6)
    assert all(isinstance(v, np.ndarray) and v.shape == (4,)
               for v in logs.values())
    # A built-in test step has no per-replica vectors.
    mirrored.test_on_batch(x, y)
    assert mirrored.last_replica_logs == {}
    # fit: the last training step's vectors (3 rows: 1/1/1/0).
    mirrored.fit(x, y, batch_size=4, verbose=0, shuffle=False)
    assert mirrored.last_replica_logs["samples"].tolist() == [1, 1, 1, 0]


class _Keys(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch, self.epoch = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch.append(sorted(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(sorted(logs))


class _OptedIn(_Keys):
    wants_replica_logs = True


def test_fit_history_and_callbacks_see_plain_keras_keys(cpus):
    reference, mirrored = _pair(cpus)
    x, y, _ = data(14)
    val = (x[:5], y[:5])
    plain, ours, opted = _Keys(), _Keys(), _OptedIn()
    ref = reference.fit(x, y, batch_size=6, epochs=2, verbose=0,
                        shuffle=False, validation_data=val,
                        callbacks=[plain])
    got = mirrored.fit(x, y, batch_size=6, epochs=2, verbose=0,
                       shuffle=False, validation_data=val,
                       callbacks=[ours, opted])
    assert sorted(got.history) == sorted(ref.history)
    assert ours.batch == plain.batch and ours.epoch == plain.epoch
    for key in ref.history:
        np.testing.assert_allclose(got.history[key], ref.history[key],
                                   rtol=2e-5, err_msg=key)
    assert "replica_loss" in opted.batch[0]
    assert "replica_samples" in opted.epoch[0]


def test_own_train_step_returns_plain_keras_keys(cpus, execution):
    x = np.linspace(-1, 1, 14, dtype="float32").reshape(7, 2)
    y = x.sum(axis=1, keepdims=True)
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        model = own_step_model(2)
        target = keras_mirror.MirroredModel(model, devices=cpus) \
            if wrap else model
        target.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                       metrics=["mae"])
        results.append((target.train_on_batch(x, y, return_dict=True),
                        target.train_on_batch(x, y)))
    (ref_dict, ref_list), (got_dict, got_list) = results
    assert list(got_dict) == list(ref_dict)
    assert len(got_list) == len(ref_list) == 2
    np.testing.assert_allclose(got_list, ref_list, rtol=1e-5)
    assert target.last_replica_logs["samples"].tolist() == [2, 2, 2, 1]
