"""`mirrored.verify(...)`: the wrapper's steps against one device's.

Exact on a Dense model, a convnet, Dropout and a GAN with its own
`train_step`; NOT exact, naming the variable that differs most, on models
known to differ (a forward pass that depends on the shard's rows, a
hand-written batch sum in a model's own step); every piece of state
restored exactly afterwards, so that a following `fit` equals a `fit`
without `verify`.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from support import guide_models
from support.helpers import max_diff

import keras_mirror

# Each test runs on both execution paths (conftest.py); a test of code both
# paths share (`verify`'s own comparison, replay and report) runs on one of
# them, named by its `parametrize("execution", ..., indirect=True)`.
pytestmark = pytest.mark.usefixtures("execution")

TOL = 1e-5


def _dense(seed=0, dropout=0.0):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(12, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    return keras.Sequential(layers + [keras.layers.Dense(2)])


def _convnet(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])


def _data(rows=40, shape=(6,), outputs=2, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, *shape)).astype("float32")
    y = rng.normal(size=(rows, outputs)).astype("float32")
    return x, y


def _wrapped(model, **compile_kwargs):
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(**{"optimizer": "adam", "loss": "mse",
                        "metrics": ["mae"], **compile_kwargs})
    return mirrored


def test_dense_model_is_exact(cpus):
    mirrored = _wrapped(_dense())
    x, y = _data()
    report = mirrored.verify(x, y, batch_size=7)  # 2/2/2/1
    assert isinstance(report, keras_mirror.VerifyReport)
    assert report.exact, report
    assert report.steps == 3
    assert report.max_weight_diff < TOL
    assert report.worst_variable in report.variable_diffs
    keys = [(step, key) for step, key, _, _ in report.logs]
    assert keys == [(s, k) for s in (1, 2, 3, "end") for k in ("loss", "mae")]
    for _, _, ours, theirs in report.logs:
        assert ours == pytest.approx(theirs, rel=TOL)


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_convnet_is_exact(cpus, execution):
    mirrored = _wrapped(_convnet())
    x, y = _data(30, shape=(8, 8, 2), outputs=3)
    report = mirrored.verify(x, y, batch_size=6, steps=4)
    assert report.exact, report
    assert report.max_weight_diff < TOL


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_dropout_is_exact_and_its_seed_state_compared(cpus, execution):
    mirrored = _wrapped(_dense(dropout=0.4))
    x, y = _data()
    report = mirrored.verify(x, y, batch_size=9)
    assert report.exact, report
    seeds = [p for p in report.variable_diffs if "seed_generator" in p]
    assert seeds and all(report.variable_diffs[p] == 0 for p in seeds)


def test_gan_with_its_own_train_step_is_exact(cpus, execution):
    model, compile_kwargs, (x, _) = guide_models.gan()
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(**compile_kwargs)
    report = mirrored.verify(x, batch_size=14, steps=3)
    assert report.exact, report
    assert {k for _, k, _, _ in report.logs} == {"d_loss", "g_loss"}


class _ShardCentering(keras.layers.Layer):
    """Subtracts the mean of the rows it sees: a replica's shard's only."""

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


def _centering(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="tanh", name="hidden"),
        _ShardCentering(),
        keras.layers.Dense(2, name="out"),
    ])


def _worst(single, model):
    """(path, diff) of the variable that differs most after both runs."""
    diffs = {v.path: float(np.max(np.abs(a.numpy() - v.numpy())))
             for a, v in zip(single.weights, model.weights)}
    worst = max(diffs, key=diffs.get)
    return worst, diffs[worst]


def _fit(target, x, y, **kwargs):
    target.fit(x, y, batch_size=7, epochs=1, steps_per_epoch=3,
               shuffle=False, verbose=0, **kwargs)


def test_a_shard_dependent_forward_pass_is_not_exact(cpus):
    x, y = _data()
    single = _centering()
    single.compile(optimizer="sgd", loss="mse")
    _fit(single, x, y)
    model = _centering()
    mirrored = _wrapped(model, optimizer="sgd", metrics=None)
    report = mirrored.verify(x, y, batch_size=7)
    assert not report.exact
    # The report's worst variable is the one that differs most when the two
    # runs are made by hand.
    _fit(mirrored, x, y)
    path, diff = _worst(single, model)
    assert report.worst_variable == path
    assert report.max_weight_diff == pytest.approx(diff, rel=1e-4)
    assert "NOT exact" in str(report)


class BatchSum(keras.Model):
    """A model's own step whose loss is a hand-written batch sum."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"sum": loss}


def _batch_sum(seed=0):
    keras.utils.set_random_seed(seed)
    model = BatchSum()
    model(np.zeros((1, 6), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    return model


def test_a_hand_written_batch_sum_is_not_exact(cpus, execution):
    x, y = _data()
    single = _batch_sum()
    _fit(single, x, y)
    model = _batch_sum()
    mirrored = keras_mirror.MirroredModel(model)
    report = mirrored.verify(x, y, batch_size=7)
    assert not report.exact
    _fit(mirrored, x, y)
    path, diff = _worst(single, model)
    assert report.worst_variable == path
    assert report.max_weight_diff == pytest.approx(diff, rel=1e-4)


def _state(mirrored):
    model = mirrored.model
    variables = [*model.variables, *model.metrics_variables,
                 *model.optimizer.variables]
    return {v.path: np.array(v.numpy()) for v in variables}


def test_state_is_restored_and_a_following_fit_is_unchanged(cpus):
    x, y = _data()
    runs = []
    for check in (True, False):
        mirrored = _wrapped(_dense(dropout=0.3))
        mirrored.fit(x[:14], y[:14], batch_size=7, verbose=0, shuffle=False)
        if check:
            before = _state(mirrored)
            history = dict(mirrored.replica_history)
            report = mirrored.verify(x, y, batch_size=7, steps=2)
            assert report.exact, report
            after = _state(mirrored)
            assert after.keys() == before.keys()
            for path in before:
                np.testing.assert_array_equal(after[path], before[path],
                                              err_msg=path)
            assert int(mirrored.optimizer.iterations) == 2
            assert len(mirrored.replica_history["batch"]) == \
                len(history["batch"])
        logs = mirrored.fit(x, y, batch_size=7, epochs=2, verbose=0,
                            shuffle=False).history
        runs.append((mirrored.model.get_weights(), logs))
    (checked, logs_a), (plain, logs_b) = runs
    # Two identical fits on 4 logical CPUs agree to the last bits or so
    # (TensorFlow's multi-threaded CPU kernels): measured 0 and 9.3e-10.
    assert max_diff(checked, plain) < 1e-7
    for key in logs_b:
        np.testing.assert_allclose(logs_a[key], logs_b[key], rtol=1e-6)


def test_verify_on_an_unbuilt_optimizer_restores_it_empty(cpus):
    x, y = _data()
    mirrored = _wrapped(_dense())
    assert mirrored.verify(x, y, batch_size=7).exact
    assert int(mirrored.optimizer.iterations) == 0
    assert all(not np.any(v.numpy()) for v in mirrored.optimizer.variables
               if "momentum" in v.path or "velocity" in v.path)


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_datasets_and_generators_replay_the_same_batches(cpus, execution):
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(9)
    mirrored = _wrapped(_dense(dropout=0.2))
    assert mirrored.verify(dataset).exact

    def batches():
        for start in range(0, 40, 6):
            yield x[start:start + 6], y[start:start + 6]

    report = mirrored.verify(batches(), steps=4)
    assert report.exact and report.steps == 4


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_per_replica_batches_are_joined_for_one_device(cpus, execution):
    x, y = _data()
    model = _dense()
    mirrored = keras_mirror.MirroredModel(model, batch="per_replica")
    mirrored.compile(optimizer="adam", loss="mse")
    report = mirrored.verify(x, y, batch_size=3, steps=2)  # 12 rows a step
    assert report.exact, report


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_verify_refuses_its_own_arguments(cpus, execution):
    mirrored = _wrapped(_dense())
    x, y = _data(8)
    with pytest.raises(ValueError, match="Received: steps=0"):
        mirrored.verify(x, y, steps=0)
    with pytest.raises(ValueError, match=r"`epochs` is its own.*"
                       r"Received: epochs=2"):
        mirrored.verify(x, y, epochs=2)
    for bad in (-1, float("nan"), True, "x", float("inf")):
        with pytest.raises(ValueError,
                           match=re.escape(f"Received: tolerance={bad!r}")):
            mirrored.verify(x, y, tolerance=bad)
    with pytest.raises(ValueError,
                       match="Received: callbacks='tensorboard'"):
        mirrored.verify(x, y, callbacks="tensorboard")


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
@pytest.mark.parametrize("name, bad", [
    ("tolerance", np.float32("nan")), ("tolerance", np.bool_(True)),
    ("tolerance", "1e-3"), ("tolerance", None), ("tolerance", 1j),
    ("tolerance", np.array([1e-3])), ("steps", np.bool_(True)),
    ("steps", 2.0), ("steps", "3"), ("steps", None)])
def test_verify_refuses_every_kind_of_bad_number(cpus, execution, name,
                                                 bad):
    mirrored = _wrapped(_dense())
    x, y = _data(8)
    what = "a finite non-negative number" if name == "tolerance" \
        else "a positive integer"
    with pytest.raises(ValueError, match=re.escape(
            f"`{name}` must be {what}. Received: {name}={bad!r}")):
        mirrored.verify(x, y, **{name: bad})


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_verify_takes_numpy_numbers_and_any_callback_container(cpus,
                                                              execution):
    # As `fit` does: NumPy scalars, a tuple or a `CallbackList`.
    mirrored = _wrapped(_dense())
    x, y = _data(8)
    seen = []
    probe = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch))
    report = mirrored.verify(x, y, batch_size=4, steps=np.int64(2),
                             tolerance=np.float32(1e-4), callbacks=(probe,))
    assert report.steps == 2 and isinstance(report.tolerance, float)
    assert seen == [0, 1, 0, 1]  # in both runs
    seen.clear()
    mirrored.verify(x, y, batch_size=4, steps=1,
                    callbacks=keras.callbacks.CallbackList([probe]))
    assert seen == [0, 0]


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
@pytest.mark.parametrize("bad, shown", [
    (keras.callbacks.History, "callbacks=<class"),
    ([keras.callbacks.History], "callbacks[0]=<class"),
    ([keras.callbacks.History(), 3], "callbacks[1]=3"),
    ({"tb": keras.callbacks.History()}, "callbacks={'tb'")])
def test_verify_names_the_bad_callback(cpus, execution, bad, shown):
    mirrored = _wrapped(_dense())
    x, y = _data(8)
    with pytest.raises(ValueError, match=r"`callbacks` must be a list of "
                       r"`keras.callbacks.Callback` objects.*Received: "
                       + re.escape(shown)):
        mirrored.verify(x, y, callbacks=bad)


def test_verify_refuses_a_step_backup_before_touching_it(cpus, tmp_path):
    mirrored = _wrapped(_dense())
    x, y = _data(8)
    backup_dir = tmp_path / "backup"
    with pytest.raises(ValueError, match=(
            r"`verify` runs two scratch trainings and cannot take a "
            r"`StepBackup`.*Remove it from `callbacks`\. Received: "
            r"callbacks=\[")):
        mirrored.verify(x, y, callbacks=[keras_mirror.StepBackup(
            str(backup_dir))])
    assert not backup_dir.exists()


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
def test_public_import_paths(execution):
    from keras_mirror import VerifyReport
    from keras_mirror.verify import VerifyReport as same

    assert VerifyReport is same is keras_mirror.VerifyReport
    assert "VerifyReport" in keras_mirror.__all__
    assert keras_mirror.MirroredModel.verify.__doc__


@pytest.mark.parametrize("execution", ["strategy"], indirect=True)
@pytest.mark.parametrize("form", ["dataset", "input_fn"])
def test_virtual_shards_are_compared_on_their_own_global_batches(
        cpus, execution, tmp_path, form):
    # One device read the pipeline's own batches, not the global batches
    # the virtual shards make: a 0.05 weight difference, "NOT exact".
    import importlib.util

    from support import helpers

    spec = importlib.util.spec_from_file_location(
        "vs_train", helpers.WORKERS / "vs_train.py")
    vs_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_train)
    vs_train.write_files(str(tmp_path))
    mirrored = keras_mirror.MirroredModel(
        vs_train.model(), devices=cpus[:2], worker_input="shard",
        virtual_shards=6)
    mirrored.compile(optimizer=vs_train.optimizer(), loss="mse")
    x = vs_train.pipeline(str(tmp_path)) if form == "dataset" else \
        vs_train.input_fn(str(tmp_path), tf.Variable(0, dtype=tf.int64))
    report = mirrored.verify(x, steps=3)
    assert report.exact and report.steps == 3, report
