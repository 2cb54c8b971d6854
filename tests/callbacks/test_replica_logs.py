"""`MirroredModel(replica_stats=False)`: no per-replica statistics.

The statistics read every gradient once more; switching them off must leave
training exact and take out exactly that work: no `replica_*` logs, no
history, no gradient-norm or clock ops in the traced step, and only the
non-finite count that `on_nonfinite="skip_step"` and `"raise"` need.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import data
from support.helpers import max_diff
from support.helpers import mlp
from support.helpers import own_step_model
from support.helpers import summary_cells

import keras_mirror
from keras_mirror.steps import _replica_stats

# Each test runs on both execution paths (conftest.py).
pytestmark = pytest.mark.usefixtures("execution")

BATCHES = (7, 3, 8)  # uneven, fewer rows than replicas, even


def _fit_batches(model, batches, rows):
    x, y, sw = data(rows)
    start = 0
    logs = []
    for size in batches:
        end = start + size
        logs.append(model.train_on_batch(
            x[start:end], y[start:end], sample_weight=sw[start:end],
            return_dict=True))
        start = end
    return logs


def test_training_stays_exact_and_logs_no_replica_keys(cpus):
    reference = mlp()
    reference.compile(optimizer="adam", loss="mse", metrics=["mae"])
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          replica_stats=False)
    mirrored.compile(optimizer="adam", loss="mse", metrics=["mae"])
    assert mirrored.replica_stats is False
    expected = _fit_batches(reference, BATCHES, sum(BATCHES))
    logs = _fit_batches(mirrored, BATCHES, sum(BATCHES))
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5
    for got, want in zip(logs, expected):
        assert set(got) == {"loss", "mae"}
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)

    x, y, _ = data(20)
    history = mirrored.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert set(history.history) == {"loss", "mae"}
    assert len(mirrored.replica_history.get("batch", ())) == 0
    assert set(mirrored.replica_history) <= {"batch"}


def _op_types(mirrored, x, y):
    step = tf.function(lambda d: mirrored.distribute_strategy.run(
        mirrored.train_step, args=(d,)))
    with mirrored._homes.mirrored():  # the variables as in `fit`
        graph = step.get_concrete_function(
            (tf.constant(x), tf.constant(y))).graph
    types = {op.type for op in graph.get_operations()}
    for function in graph.as_graph_def().library.function:
        types.update(node.op for node in function.node_def)
    return types


@pytest.mark.parametrize("on_nonfinite", ["warn", "skip_step"])
def test_the_traced_step_computes_only_what_is_asked(cpus, on_nonfinite):
    x, y, _ = data(6)
    types = {}
    for stats in (True, False):
        mirrored = keras_mirror.MirroredModel(
            mlp(), devices=cpus[:2], replica_stats=stats,
            on_nonfinite=on_nonfinite)
        mirrored.compile(optimizer="sgd", loss="mse")
        mirrored.train_on_batch(x, y)
        types[stats] = _op_types(mirrored, x, y)
    # The gradient norm (L2Loss) and the step clock (Timestamp) are the
    # statistics' own ops: present by default, gone without statistics.
    assert {"L2Loss", "Timestamp"} <= types[True]
    assert "Timestamp" not in types[False]
    # The non-finite count reads the gradients' sum of squares: it stays
    # only where `on_nonfinite` acts on it.
    assert ("L2Loss" in types[False]) == (on_nonfinite == "skip_step")


def _nan_batch(rows=16, bad_row=9):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = rng.normal(size=(rows, 3)).astype("float32")
    x[bad_row, 2] = np.nan  # the balanced 4/4/4/4 plan: replica 2's rows
    return x, y


def test_skip_step_keeps_the_exact_nonfinite_count(cpus):
    x, y = _nan_batch()
    results = {}
    for stats in (True, False):
        mirrored = keras_mirror.MirroredModel(
            mlp(), devices=cpus, replica_stats=stats,
            on_nonfinite="skip_step")
        mirrored.compile(optimizer="sgd", loss="mse")
        mirrored.train_on_batch(x[:4], y[:4])  # build and trace
        before = [w.copy() for w in mirrored.model.get_weights()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = mirrored.fit(x, y, batch_size=16, shuffle=False,
                                   verbose=0)
        messages = [str(w.message) for w in caught
                    if issubclass(w.category, RuntimeWarning)]
        assert max_diff(before, mirrored.model.get_weights()) == 0.0
        results[stats] = (history.history, messages,
                          mirrored.replica_history)
    on, off = results[True], results[False]
    # History keeps plain Keras's keys; the counts are in replica_history.
    assert set(off[0]) == set(on[0]) == {"loss"}
    counts = np.asarray(on[2]["nonfinite"][0])
    assert counts[2] > 0 and counts[[0, 1, 3]].sum() == 0
    np.testing.assert_array_equal(off[2]["nonfinite"][0], counts)
    assert off[1] == on[1] and len(off[1]) == 1
    assert "on replica(s) [2]" in off[1][0]
    assert off[2]["nonfinite"] == on[2]["nonfinite"]
    assert off[2]["batch"].array("nonfinite").tolist() == [counts.tolist()]


def test_raise_still_raises_without_statistics(cpus):
    x, y = _nan_batch()
    mirrored = keras_mirror.MirroredModel(
        mlp(), devices=cpus, replica_stats=False, on_nonfinite="raise")
    mirrored.compile(optimizer="sgd", loss="mse")
    with pytest.raises(keras_mirror.errors.NonFiniteError,
                       match=r"at step 1 on replica\(s\) \[2\]"):
        mirrored.fit(x, y, batch_size=16, shuffle=False, verbose=0)


def test_summary_names_the_statistics(cpus):
    for stats, on_nonfinite, line in (
            (True, "warn", ", ".join(_replica_stats.STAT_KEYS)),
            (False, "warn", "none (replica_stats=False)"),
            (False, "raise", "replica_nonfinite (replica_stats=False)")):
        mirrored = keras_mirror.MirroredModel(
            mlp(), devices=cpus[:2], replica_stats=stats,
            on_nonfinite=on_nonfinite)
        _, cells = summary_cells(mirrored)
        assert cells["Per-replica statistics"] == line


def test_replica_tensorboard_refuses_a_model_without_statistics(
        cpus, tmp_path):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          replica_stats=False)
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(8)
    board = keras_mirror.callbacks.ReplicaTensorBoard(str(tmp_path))
    with pytest.raises(ValueError) as info:
        mirrored.fit(x, y, batch_size=8, verbose=0, callbacks=[board])
    assert str(info.value) == (
        "ReplicaTensorBoard writes per-replica statistics, and this "
        "MirroredModel computes none. Construct it with "
        "`replica_stats=True` (the default), or log the global values "
        "with `keras.callbacks.TensorBoard`. Received: replica_stats=False")
    assert not list(tmp_path.iterdir())


def test_own_train_step_logs_only_the_global_values(cpus, execution):
    x = np.linspace(-1, 1, 14, dtype="float32").reshape(7, 2)
    y = x.sum(axis=1, keepdims=True)
    logs = {}
    for stats in (True, False):
        keras.utils.set_random_seed(0)
        mirrored = keras_mirror.MirroredModel(
            own_step_model, devices=cpus[:3],
            replica_stats=stats)
        mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        logs[stats] = mirrored.train_on_batch(x, y, return_dict=True)
        logs[stats, "vectors"] = mirrored.last_replica_logs
    assert set(logs[True]) == set(logs[False]) == {"loss"}
    assert set(logs[True, "vectors"]) == {"loss", "samples"}
    assert logs[False, "vectors"] == {}
    assert logs[False]["loss"] == pytest.approx(logs[True]["loss"],
                                                rel=1e-6)


class _OwnNames(keras.callbacks.Callback):
    """The hooks Keras's `CallbackList` passes logs to positionally, with
    that parameter named otherwise (the batch hooks get `logs=`)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _note(self, name, log):
        self.seen.append((name, sorted(log or {})))

    def on_train_begin(self, log=None):
        self._note("train_begin", log)

    def on_epoch_end(self, epoch, log=None):
        self._note("epoch_end", log)

    def on_train_batch_end(self, batch, logs=None):
        self._note("train_batch_end", logs)

    def on_test_batch_end(self, batch, logs=None):
        self._note("test_batch_end", logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._note("predict_batch_end", logs)

    def on_test_end(self, log=None):
        self._note("test_end", log)

    def on_train_end(self, log=None):
        self._note("train_end", log)


def test_hooks_get_logs_positionally_as_keras_passes_them(cpus):
    x = np.linspace(-1, 1, 16, dtype="float32").reshape(8, 2)
    y = x.sum(axis=1, keepdims=True)
    seen = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        runner = keras_mirror.MirroredModel(model, devices=cpus) if wrap \
            else model
        callback = _OwnNames()
        runner.fit(x, y, batch_size=4, epochs=1, verbose=0,
                   callbacks=[callback])
        runner.evaluate(x, y, batch_size=4, verbose=0, callbacks=[callback])
        runner.predict(x, batch_size=4, verbose=0, callbacks=[callback])
        seen.append(callback.seen)
    assert seen[1] == seen[0]
    assert ("epoch_end", ["loss"]) in seen[1]
