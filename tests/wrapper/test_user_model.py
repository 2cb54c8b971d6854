"""A callback's `self.model` during `mirrored.fit` is the user's model.

Keras's own callbacks (ModelCheckpoint, EarlyStopping, ReduceLROnPlateau,
LearningRateScheduler, BackupAndRestore, TensorBoard) and a user's callback
that reaches into the layers give the same results as in plain Keras `fit`:
each test runs plain Keras and the wrapper from the same seed, with the same
callbacks, and compares weights (1e-5), epochs run and files written.
"""

import os

import keras
import numpy as np
import pytest
from support.helpers import max_diff
from support.helpers import own_step_model

import keras_mirror

# Each test runs on both execution paths (conftest.py); a test of code both
# paths share (Keras's callbacks reaching the user's model) runs on one of
# them, named by its `parametrize("execution", ..., indirect=True)`.
pytestmark = pytest.mark.usefixtures("execution")

TOL = 1e-5


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(6, activation="tanh", name="lstm"),
        keras.layers.Dense(1, name="head"),
    ], name="net")


def _data(rows=30):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    return x, y


def _fit(wrap, callbacks, epochs=4, seed=3, optimizer="sgd", **kwargs):
    """(model, History) of a fit, plain (`wrap=False`) or wrapped."""
    model = _model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    target = keras_mirror.MirroredModel(model) if wrap else model
    x, y = _data()
    history = target.fit(x, y, batch_size=7, epochs=epochs, shuffle=False,
                         verbose=0, callbacks=callbacks(), **kwargs)
    return model, history


def _same_as_plain(callbacks, **kwargs):
    single, h1 = _fit(False, callbacks, **kwargs)
    model, h2 = _fit(True, callbacks, **kwargs)
    assert max_diff(single.get_weights(), model.get_weights()) < TOL
    assert len(h2.history["loss"]) == len(h1.history["loss"])
    return single, model, h1, h2


class _Reach(keras.callbacks.Callback):
    """Reaches into the model as user callbacks do."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        layer = self.model.get_layer("lstm")
        kernel = layer.get_weights()[0]
        assert self.model.layers[0] is layer
        name = self.model.name
        assert [v.path for v in self.model.weights] == [
            f"{name}/lstm/kernel", f"{name}/lstm/bias",
            f"{name}/head/kernel", f"{name}/head/bias"]
        np.testing.assert_array_equal(self.model.get_weights()[0], kernel)
        self.seen.append(kernel.copy())

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:  # a callback may move the weights; the fit goes on
            self.model.set_weights([w * 0.5 for w in self.model.get_weights()])
        if epoch == 2:
            self.model.stop_training = True


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_user_callback_reaches_layers_and_stops_training(cpus, execution):
    plain, ours = _Reach(), _Reach()
    single, h1 = _fit(False, lambda: [plain])
    model, h2 = _fit(True, lambda: [ours])
    assert len(h1.history["loss"]) == len(h2.history["loss"]) == 3
    assert len(ours.seen) == len(plain.seen) == 15
    assert max_diff(ours.seen, plain.seen) < TOL
    assert max_diff(single.get_weights(), model.get_weights()) < TOL


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_the_callback_model_is_the_users_object(cpus, execution):
    seen = []
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    mirrored = keras_mirror.MirroredModel(model)
    callback = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: seen.append(callback.model),
        on_test_begin=lambda logs: seen.append(callback.model),
        on_predict_begin=lambda logs: seen.append(callback.model))
    x, y = _data(10)
    history = mirrored.fit(x, y, batch_size=4, verbose=0,
                           validation_data=(x, y), callbacks=[callback])
    mirrored.evaluate(x, y, verbose=0, callbacks=[callback])
    mirrored.predict(x, verbose=0, callbacks=[callback])
    assert len(seen) == 4 and all(m is model for m in seen)
    assert model.history is history and mirrored.history is history
    # The save routing is on the model during the call only.
    assert "save" not in vars(model) and "save_weights" not in vars(model)


def test_early_stopping_restores_the_best_weights(cpus):
    def callbacks():
        return [keras.callbacks.EarlyStopping(
            monitor="loss", patience=1, min_delta=10.0,
            restore_best_weights=True)]

    _, _, h1, h2 = _same_as_plain(callbacks, epochs=6)
    assert len(h1.history["loss"]) == 2  # stopped early, in both


def test_reduce_lr_on_plateau_changes_the_learning_rate(cpus):
    def callbacks():
        return [keras.callbacks.ReduceLROnPlateau(
            monitor="loss", factor=0.5, patience=0, min_delta=10.0)]

    single, model, h1, h2 = _same_as_plain(callbacks)
    lr = float(model.optimizer.learning_rate.numpy())
    assert lr == pytest.approx(0.01 * 0.5 ** 3)  # after epochs 2, 3, 4
    np.testing.assert_allclose(h2.history["learning_rate"],
                               h1.history["learning_rate"])


def test_learning_rate_scheduler_takes_effect(cpus):
    def callbacks():
        return [keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: 0.1 / (epoch + 1))]

    single, model, _, _ = _same_as_plain(callbacks)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(
        0.025)
    lost = _fit(True, lambda: [])[0]  # the schedule changed the weights
    assert max_diff(lost.get_weights(), model.get_weights()) > 1e-3


def test_model_checkpoint_files_load_in_plain_keras(cpus, tmp_path):
    def callbacks(folder):
        return lambda: [
            keras.callbacks.ModelCheckpoint(
                str(folder / "m_{epoch}.keras")),
            keras.callbacks.ModelCheckpoint(
                str(folder / "w.weights.h5"), save_weights_only=True)]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    single, _ = _fit(False, callbacks(tmp_path / "a"), epochs=2)
    model, _ = _fit(True, callbacks(tmp_path / "b"), epochs=2)
    names = ["m_1.keras", "m_2.keras", "w.weights.h5"]
    assert sorted(os.listdir(tmp_path / "a")) == names
    assert sorted(os.listdir(tmp_path / "b")) == names
    for name in names[:2]:
        a = keras.saving.load_model(tmp_path / "a" / name)
        b = keras.saving.load_model(tmp_path / "b" / name)
        assert type(b) is keras.Sequential
        assert max_diff(a.get_weights(), b.get_weights()) < TOL
        assert int(b.optimizer.iterations) == int(a.optimizer.iterations)
    fresh = _model(seed=9)
    fresh.load_weights(tmp_path / "b" / "w.weights.h5")
    assert max_diff(fresh.get_weights(), model.get_weights()) == 0.0


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_at_the_saved_epoch(cpus, tmp_path):
    single, _ = _fit(False, lambda: [], epochs=4)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(True, lambda: [keras.callbacks.BackupAndRestore(backup),
                            _Interrupt()], epochs=4)
    model, history = _fit(
        True, lambda: [keras.callbacks.BackupAndRestore(backup)], epochs=4)
    assert len(history.history["loss"]) == 2  # epochs 3 and 4
    assert int(model.optimizer.iterations) == 4 * 5
    assert max_diff(single.get_weights(), model.get_weights()) < TOL


def _tags(log_dir):
    from tensorboard.backend.event_processing import event_accumulator

    out = set()
    for root, _, files in os.walk(log_dir):
        if any(".tfevents." in f for f in files):
            acc = event_accumulator.EventAccumulator(root)
            acc.Reload()
            run = os.path.relpath(root, log_dir)
            out |= {(run, tag) for kind in ("tensors", "histograms")
                    for tag in acc.Tags().get(kind, [])}
    return out


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_tensorboard_writes_plain_keras_tags(cpus, execution, tmp_path):
    def callbacks(folder):
        return lambda: [keras.callbacks.TensorBoard(
            str(folder), histogram_freq=1, write_graph=False,
            update_freq="batch")]

    _fit(False, callbacks(tmp_path / "a"), epochs=2)
    _fit(True, callbacks(tmp_path / "b"), epochs=2)
    plain = _tags(tmp_path / "a")
    assert ("train", "net/lstm/kernel/histogram") in plain
    assert _tags(tmp_path / "b") == plain


class _Probe(keras.callbacks.Callback):
    """For a model with its own `train_step`: its layers, by attribute."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def on_epoch_end(self, epoch, logs=None):
        probe = np.ones((2, 3), "float32")
        self.outputs.append(np.asarray(self.model.dense(probe)))
        name = self.model.dense.name
        assert self.model.get_layer(name) is self.model.dense


def test_own_train_step_model_callbacks(cpus, execution, tmp_path):
    x, y = _data(14)
    x = x[:, :3]
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        model = own_step_model(3)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        target = keras_mirror.MirroredModel(model) if wrap else model
        probe = _Probe()
        path = str(tmp_path / f"own_{wrap}.weights.h5")
        target.fit(x, y, batch_size=5, epochs=4, shuffle=False, verbose=0,
                   callbacks=[probe, keras.callbacks.ModelCheckpoint(
                       path, save_weights_only=True),
                       keras.callbacks.EarlyStopping(
                           monitor="loss", patience=0, min_delta=10.0)])
        results.append((model, probe.outputs, path))
    (single, plain, _), (model, ours, path) = results
    assert len(ours) == len(plain) == 2
    assert max_diff(ours, plain) < TOL
    assert max_diff(single.get_weights(), model.get_weights()) < TOL
    fresh = own_step_model(3)
    fresh.load_weights(path)
    assert max_diff(fresh.get_weights(), model.get_weights()) == 0.0
