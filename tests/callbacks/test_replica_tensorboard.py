"""Tests of `keras_mirror.callbacks.ReplicaTensorBoard`.

Event files are read back with TensorBoard's own reader. `tf.summary` writes
scalars as tensors, hence `size_guidance={"tensors": 0}` (keep all).
"""

import csv
import logging
import os
import re
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import keras_mirror
from keras_mirror.callbacks import ReplicaTensorBoard

REPLICA_KEYS = ("loss", "samples", "sample_weight", "grad_norm", "nonfinite",
                "step_time")
RUNS = ("replica_0", "replica_1", "replica_2", "replica_3")


def read_scalars(log_dir):
    """{(run, tag): [(step, value), ...]} of every run under `log_dir`."""
    out = {}
    for root, _, files in os.walk(log_dir):
        if not any(".tfevents." in f for f in files):
            continue
        run = os.path.relpath(root, log_dir)
        acc = event_accumulator.EventAccumulator(
            root, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            events = acc.Tensors(tag)
            if events and events[0].tensor_proto.dtype == tf.string:
                continue  # Keras's model summary text, not a scalar.
            out[(run, tag)] = [
                (e.step, float(tf.make_ndarray(e.tensor_proto)))
                for e in events
            ]
    return out


def replica_pairs(prefixes=("batch_", "epoch_")):
    return {(run, p + key) for run in RUNS for p in prefixes
            for key in REPLICA_KEYS}


def make_model(seed=7):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(1),
    ])


def make_data(rows=23):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    return x, y


def mirrored_model(metrics=("mae",)):
    mirrored = keras_mirror.MirroredModel(make_model())
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                     metrics=list(metrics))
    return mirrored


# -- arguments ---------------------------------------------------------------


@pytest.mark.parametrize("bad", ["step", 0, -2, 1.5, True, None])
def test_update_freq_is_validated(bad):
    with pytest.raises(ValueError, match=r"Received: update_freq="):
        ReplicaTensorBoard("logs", update_freq=bad)


def test_write_global_is_validated():
    with pytest.raises(ValueError, match=r"Received: write_global='no'"):
        ReplicaTensorBoard("logs", write_global="no")


def test_import_path():
    from keras_mirror.callbacks import replica_tensorboard

    assert ReplicaTensorBoard is replica_tensorboard.ReplicaTensorBoard
    assert ReplicaTensorBoard.wants_replica_logs is True


def test_epoch_freq_overrides_no_batch_hook():
    epoch = ReplicaTensorBoard("logs")
    batch = ReplicaTensorBoard("logs", update_freq="batch")
    hooks = ("on_train_batch_begin", "on_train_batch_end",
             "on_test_batch_begin", "on_test_batch_end",
             "on_predict_batch_begin", "on_predict_batch_end")
    for hook in hooks:
        assert getattr(getattr(epoch, hook), "_is_default", False), hook
    assert not getattr(batch.on_train_batch_end, "_is_default", False)
    assert getattr(batch.on_train_batch_begin, "_is_default", False)


# -- runs, tags and values ----------------------------------------------------


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    """One fit logged every batch, read back: (scalars, history, plans).

    23 rows in batches of 10 (the last 3 rows: one replica empty), 2 epochs,
    validation on the same rows. The tests below only read it.
    """
    log_dir = tmp_path_factory.mktemp("batch_run")
    x, y = make_data(23)
    mirrored = mirrored_model()
    mirrored.fit(x, y, batch_size=10, epochs=2, verbose=0, shuffle=False,
                 validation_data=(x, y), callbacks=[
                     ReplicaTensorBoard(log_dir, update_freq="batch")])
    plans = [mirrored.split_plan(b) for b in (10, 10, 3)]
    return read_scalars(log_dir), mirrored.history.history, plans


def test_exact_runs_and_tags(batch_run):
    scalars, history, _ = batch_run
    assert set(scalars) == replica_pairs() | {
        ("train", "batch_loss"), ("train", "batch_mae"),
        ("train", "epoch_loss"), ("train", "epoch_mae"),
        ("validation", "epoch_loss"), ("validation", "epoch_mae"),
    }
    for (run, tag), points in scalars.items():
        steps = [s for s, _ in points]
        expected = [1, 2, 3, 4, 5, 6] if tag.startswith("batch_") else [0, 1]
        assert steps == expected, (run, tag)
    assert [v for _, v in scalars[("train", "epoch_loss")]] == \
        pytest.approx(history["loss"], rel=1e-6)
    assert [v for _, v in scalars[("validation", "epoch_mae")]] == \
        pytest.approx(history["val_mae"], rel=1e-6)


def test_batch_samples_follow_split_plan(batch_run):
    scalars, _, plans = batch_run
    assert plans == [(3, 3, 2, 2), (3, 3, 2, 2), (1, 1, 1, 0)]
    for r, run in enumerate(RUNS):
        samples = scalars[(run, "batch_samples")]
        assert samples == [(s + 1, float(p[r]))
                           for s, p in enumerate(plans * 2)]
        assert scalars[(run, "batch_sample_weight")] == samples
        assert scalars[(run, "epoch_samples")] == [
            (0, float(sum(p[r] for p in plans))),
            (1, float(sum(p[r] for p in plans)))]
        assert {v for _, v in scalars[(run, "batch_nonfinite")]} == {0.0}


def test_weighted_replica_loss_is_single_device_loss(tmp_path):
    x, y = make_data(23)
    sw = np.linspace(0.5, 2.0, 23).astype("float32")
    single = make_model()
    single.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mirrored = mirrored_model(metrics=())
    mirrored.fit(x, y, sample_weight=sw, batch_size=10, epochs=2, verbose=0,
                 shuffle=False, callbacks=[
                     ReplicaTensorBoard(tmp_path, update_freq="batch")])
    scalars = read_scalars(tmp_path)
    bounds = [(0, 10), (10, 20), (20, 23)] * 2
    for step, (lo, hi) in enumerate(bounds, start=1):
        expected = single.train_on_batch(x[lo:hi], y[lo:hi],
                                         sample_weight=sw[lo:hi])
        losses = np.array([scalars[(r, "batch_loss")][step - 1][1]
                           for r in RUNS])
        rows = np.array([scalars[(r, "batch_samples")][step - 1][1]
                         for r in RUNS])
        weights = np.array([scalars[(r, "batch_sample_weight")][step - 1][1]
                            for r in RUNS])
        assert rows.sum() == hi - lo
        assert weights.sum() == pytest.approx(sw[lo:hi].sum(), rel=1e-6)
        assert (losses * rows).sum() / rows.sum() == \
            pytest.approx(expected, rel=1e-5), step


def test_int_update_freq(tmp_path):
    x, y = make_data(25)
    mirrored = mirrored_model(metrics=())
    mirrored.fit(x, y, batch_size=5, epochs=2, verbose=0, callbacks=[
        ReplicaTensorBoard(tmp_path, update_freq=3)])
    scalars = read_scalars(tmp_path)
    assert set(scalars) == replica_pairs() | {
        ("train", "batch_loss"), ("train", "epoch_loss")}
    for (run, tag), points in scalars.items():
        expected = [3, 6, 9] if tag.startswith("batch_") else [0, 1]
        assert [s for s, _ in points] == expected, (run, tag)


def test_epoch_update_freq_writes_no_batch_tags(tmp_path):
    x, y = make_data()
    mirrored = mirrored_model(metrics=())
    mirrored.fit(x, y, batch_size=10, epochs=3, verbose=0,
                 callbacks=[ReplicaTensorBoard(tmp_path)])
    scalars = read_scalars(tmp_path)
    assert set(scalars) == replica_pairs(("epoch_",)) | {
        ("train", "epoch_loss")}
    assert [s for s, _ in scalars[("replica_3", "epoch_loss")]] == [0, 1, 2]
    epoch_loss = mirrored.replica_history["loss"]
    for r, run in enumerate(RUNS):
        assert [v for _, v in scalars[(run, "epoch_loss")]] == \
            pytest.approx([e[r] for e in epoch_loss], rel=1e-6)


def test_beside_keras_tensorboard(tmp_path):
    x, y = make_data()
    mirrored = mirrored_model()
    mirrored.fit(x, y, batch_size=10, epochs=2, verbose=0,
                 validation_data=(x, y), callbacks=[
                     keras.callbacks.TensorBoard(tmp_path, update_freq=2),
                     ReplicaTensorBoard(tmp_path, update_freq="batch",
                                        write_global=False)])
    scalars = read_scalars(tmp_path)
    keras_pairs = {
        ("train", "batch_loss"), ("train", "batch_mae"),
        ("train", "epoch_loss"), ("train", "epoch_mae"),
        ("train", "epoch_learning_rate"),
        ("validation", "epoch_loss"), ("validation", "epoch_mae"),
        ("validation", "evaluation_loss_vs_iterations"),
        ("validation", "evaluation_mae_vs_iterations"),
    }
    assert set(scalars) == replica_pairs() | keras_pairs
    # Keras's `record_if` (every 2nd batch) does not thin out ours.
    assert [s for s, _ in scalars[("replica_0", "batch_loss")]] == \
        [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalars[("train", "batch_loss")]] == [2, 4, 6]


def test_writers_are_lazy_and_closed_at_train_end(tmp_path, monkeypatch):
    from keras_mirror.callbacks import replica_tensorboard

    created = []
    create = replica_tensorboard.EventFileWriter

    def spy(path, *args, **kwargs):
        created.append(os.path.relpath(path, tmp_path))
        writer = create(path, *args, **kwargs)
        created.append(writer)
        return writer

    monkeypatch.setattr(replica_tensorboard, "EventFileWriter", spy)
    callback = ReplicaTensorBoard(tmp_path)
    x, y = make_data()
    mirrored = mirrored_model(metrics=())
    callback.set_model(mirrored)
    assert created == [] and not os.listdir(tmp_path)
    mirrored.fit(x, y, batch_size=10, epochs=1, verbose=0,
                 callbacks=[callback])
    runs, writers = created[0::2], created[1::2]
    assert sorted(runs) == sorted(RUNS + ("train",))
    assert callback._writers == {}
    for writer in writers:
        with pytest.raises(IOError, match="closed"):
            writer.flush()


def test_writer_failure_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    board = ReplicaTensorBoard(blocker, update_freq="batch")
    # Made after the callback (which refuses a file given as `log_dir`).
    blocker.write_text("a file where the log directory should be")
    x, y = make_data()
    mirrored = mirrored_model(metrics=())
    with caplog.at_level(logging.WARNING):
        history = mirrored.fit(x, y, batch_size=10, epochs=2, verbose=0,
                               callbacks=[board])
    assert len(history.history["loss"]) == 2
    messages = [r.getMessage() for r in caplog.records
                if "ReplicaTensorBoard" in r.getMessage()]
    # One message per run, not one per write.
    assert len(messages) == len(RUNS) + 1, messages


# -- other callbacks with the vectors present --------------------------------


def test_progress_bar_hides_replica_keys(tmp_path, capsys):
    x, y = make_data()
    mirrored = mirrored_model()
    mirrored.fit(x, y, batch_size=10, epochs=2, verbose=1,
                 callbacks=[ReplicaTensorBoard(tmp_path, update_freq="batch")])
    out = capsys.readouterr().out
    assert "loss:" in out and "mae:" in out
    assert "replica_" not in out


def test_csv_logger_and_history_without_vectors(tmp_path):
    x, y = make_data()
    mirrored = mirrored_model(metrics=())
    path = tmp_path / "log.csv"
    history = mirrored.fit(x, y, batch_size=10, epochs=2, verbose=0,
                           callbacks=[
                               ReplicaTensorBoard(tmp_path / "tb"),
                               keras.callbacks.CSVLogger(str(path))])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    # The vectors go to ReplicaTensorBoard only, not to the CSV or History.
    # (Keras's CSVLogger adds `val_` columns itself when none were logged.)
    assert list(rows[0]) == ["epoch", "loss", "val_loss"]
    assert list(history.history) == ["loss"]
    assert len(history.history["loss"]) == 2
    assert mirrored.replica_history["samples"] == [[7.0, 7.0, 5.0, 4.0]] * 2


# -- multi-worker attributes and custom vectors ------------------------------


def _fake_model(**attrs):
    return types.SimpleNamespace(num_replicas=4, **attrs)


def test_writes_only_local_replicas_and_chief_globals(tmp_path):
    logs = {
        "loss": 0.5,
        "replica_loss": np.array([1.0, 2.0, 3.0, 4.0]),
        "replica_d_loss": np.array([10.0, 20.0, 30.0, 40.0]),
    }
    worker = ReplicaTensorBoard(tmp_path, update_freq="batch")
    worker.set_model(_fake_model(local_replica_ids=[2, 3], is_chief=False))
    worker.on_train_begin()
    worker.on_train_batch_end(0, logs=logs)
    worker.on_epoch_end(0, logs=dict(logs, val_loss=0.25))
    worker.on_train_end()
    assert read_scalars(tmp_path) == {
        (run, prefix + tag): [(step, value)]
        for run, scale in (("replica_2", 3.0), ("replica_3", 4.0))
        for prefix, step in (("batch_", 1), ("epoch_", 0))
        for tag, value in (("loss", scale), ("d_loss", 10 * scale))
    }

    chief_dir = tmp_path / "chief"
    chief = ReplicaTensorBoard(chief_dir)
    chief.set_model(_fake_model(local_replica_ids=[0, 1], is_chief=True))
    chief.on_train_begin()
    chief.on_epoch_end(0, logs=dict(logs, val_loss=0.25))
    chief.on_train_end()
    assert read_scalars(chief_dir) == {
        ("replica_0", "epoch_loss"): [(0, 1.0)],
        ("replica_0", "epoch_d_loss"): [(0, 10.0)],
        ("replica_1", "epoch_loss"): [(0, 2.0)],
        ("replica_1", "epoch_d_loss"): [(0, 20.0)],
        ("train", "epoch_loss"): [(0, 0.5)],
        ("validation", "epoch_loss"): [(0, 0.25)],
    }


@pytest.mark.parametrize("log_dir", [None, 123, ""])
def test_log_dir_must_be_a_path(log_dir):
    with pytest.raises(ValueError, match=(
            r"`log_dir` must be a non-empty str or path-like\. "
            rf"Received: log_dir={log_dir!r}")):
        keras_mirror.ReplicaTensorBoard(log_dir=log_dir)


def test_log_dir_naming_an_existing_file_is_refused(tmp_path):
    # Every writer failed and was skipped: fit trained and wrote nothing.
    path = tmp_path / "logs"
    path.write_text("")
    with pytest.raises(ValueError, match=re.escape(
            "`log_dir` must be a directory, or a path where one can be "
            "made: it names an existing file, where no run can be written. "
            f"Received: log_dir={str(path)!r}")):
        keras_mirror.ReplicaTensorBoard(log_dir=path)
    keras_mirror.ReplicaTensorBoard(log_dir=tmp_path)  # a directory
    keras_mirror.ReplicaTensorBoard(log_dir=tmp_path / "new" / "runs")
