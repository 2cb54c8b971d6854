"""Host-side bookkeeping of the per-replica logs: unpacking and history."""

import csv
import types

import keras
import numpy as np
import pytest
from support.helpers import data
from support.helpers import mlp

import keras_mirror
from keras_mirror.callbacks import _replica_logs
from keras_mirror.callbacks import replica_history
from keras_mirror.callbacks.replica_history import StepHistory
from keras_mirror.steps import _replica_stats

NAMES = tuple(k[len("replica_"):] for k in _replica_stats.STAT_KEYS)


def _packed(step, replicas=3):
    """A `[replicas, keys]` matrix whose values name their place.

    The non-finite counts stay 0 (else the recorder warns).
    """
    matrix = np.array([[100 * step + 10 * r + j
                        for j in range(len(NAMES))] for r in range(replicas)],
                      dtype=np.float32)
    matrix[:, NAMES.index("nonfinite")] = 0
    return matrix


def test_unpack_splits_the_packed_matrix_into_vectors():
    logs = _replica_stats.unpack({"loss": 1.5,
                                 _replica_stats.PACKED: _packed(2)})
    assert list(logs) == ["loss", *_replica_stats.STAT_KEYS]
    for j, key in enumerate(_replica_stats.STAT_KEYS):
        expected = [0, 0, 0] if key == "replica_nonfinite" else [
            200 + j, 210 + j, 220 + j]
        assert logs[key].tolist() == expected
    plain = {"loss": 1.0, "replica_d_loss": np.ones(2)}
    assert _replica_stats.unpack(plain) is plain


def test_unpack_with_fewer_keys_and_a_mismatch():
    # `replica_stats=False` with on_nonfinite="skip_step" packs one column.
    one = np.array([[0.0], [3.0], [0.0]], np.float32)
    logs = _replica_stats.unpack({"loss": 1.0, _replica_stats.PACKED: one},
                                ("replica_nonfinite",))
    assert list(logs) == ["loss", "replica_nonfinite"]
    assert logs["replica_nonfinite"].tolist() == [0, 3, 0]
    with pytest.raises(ValueError) as info:
        _replica_stats.unpack({_replica_stats.PACKED: one})
    assert str(info.value) == (
        "The packed per-replica statistics have 1 columns; expected one "
        f"per key of {_replica_stats.STAT_KEYS}.")


def _recorder(replicas=3, on_nonfinite="warn"):
    mirrored = types.SimpleNamespace(replica_history={},
                                     on_nonfinite=on_nonfinite)
    return mirrored, replica_history.ReplicaHistory(mirrored)


def test_step_history_reads_like_a_list_of_dicts():
    mirrored, recorder = _recorder()
    recorder.on_epoch_begin(0)
    for step in range(4):
        recorder.on_train_batch_end(step, _replica_stats.unpack(
            {"loss": 0.0, _replica_stats.PACKED: _packed(step)}))
    steps = mirrored.replica_history["batch"]
    assert isinstance(steps, StepHistory) and len(steps) == 4
    assert steps[1] == {n: [0, 0, 0] if n == "nonfinite" else
                        [100 + j, 110 + j, 120 + j]
                        for j, n in enumerate(NAMES)}
    assert steps[-1] == steps[3]
    assert [s["loss"][0] for s in steps] == [0, 100, 200, 300]
    assert steps[1:3] == [steps[1], steps[2]]
    np.testing.assert_array_equal(
        steps.array("samples"),
        [[100 * s + 10 * r + 1 for r in range(3)] for s in range(4)])
    # 8 bytes per value, nothing else per step.
    assert steps.nbytes == 4 * len(NAMES) * 3 * 8
    with pytest.raises(IndexError, match=r"4 steps recorded\. "
                       r"Received: index=4"):
        steps[4]
    with pytest.raises(KeyError, match=r"No step logged `accuracy`"):
        steps.array("accuracy")


def test_epoch_values_aggregate_the_epoch_steps_only():
    mirrored, recorder = _recorder(replicas=2)
    for epoch, rows in enumerate(([3, 1], [2, 2])):
        recorder.on_epoch_begin(epoch)
        for step in range(2):
            matrix = np.zeros((2, len(NAMES)), np.float32)
            matrix[:, NAMES.index("loss")] = [step + 1, 10 * epoch]
            matrix[:, NAMES.index("samples")] = rows
            matrix[:, NAMES.index("grad_norm")] = [2 * step, 4]
            recorder.on_train_batch_end(step, _replica_stats.unpack(
                {_replica_stats.PACKED: matrix}))
        logs = {}
        recorder.on_epoch_end(epoch, logs)
        # Sample-weighted loss, summed samples, mean norm, per replica.
        assert logs["replica_loss"].tolist() == [1.5, 10.0 * epoch]
        assert logs["replica_samples"].tolist() == [2 * r for r in rows]
        assert logs["replica_grad_norm"].tolist() == [1.0, 4.0]
    assert mirrored.replica_history["loss"] == [[1.5, 0.0], [1.5, 10.0]]
    assert len(mirrored.replica_history["batch"]) == 4


def test_fit_fills_the_step_history_in_split_plan_order(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus[:3])
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(23)
    mirrored.fit(x, y, batch_size=8, epochs=2, verbose=0)
    steps = mirrored.replica_history["batch"]
    assert len(steps) == 6
    np.testing.assert_array_equal(
        steps.array("samples"), [mirrored.split_plan(8)] * 2
        + [mirrored.split_plan(7)] + [mirrored.split_plan(8)] * 2
        + [mirrored.split_plan(7)])
    epoch = np.sum([mirrored.split_plan(8)] * 2 + [mirrored.split_plan(7)],
                   axis=0).tolist()
    assert epoch == [9, 8, 6]
    assert mirrored.replica_history["samples"] == [epoch, epoch]


# -- what existing callbacks see: exactly plain Keras's logs -----------------


class _Recorder(keras.callbacks.Callback):
    """Records the log keys of every hook it sees."""

    def __init__(self):
        super().__init__()
        self.keys = set()

    def on_train_batch_end(self, batch, logs=None):
        self.keys |= set(logs)

    def on_epoch_end(self, epoch, logs=None):
        self.keys |= set(logs)


class _OptedIn(_Recorder):
    wants_replica_logs = True


def _fit_with_loggers(fit, tmp_path, name):
    path = tmp_path / f"{name}.csv"
    recorder, opted_in = _Recorder(), _OptedIn()
    history = fit(callbacks=[keras.callbacks.CSVLogger(str(path)),
                             recorder, opted_in])
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    return history.history, header, recorder.keys, opted_in.keys


def test_history_and_csv_logger_see_plain_keras_keys(cpus, tmp_path):
    x, y, _ = data(23)
    kwargs = dict(x=x, y=y, batch_size=10, epochs=2, shuffle=False,
                  verbose=0, validation_data=(x[:7], y[:7]))
    plain = mlp()
    plain.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse", metrics=["mae"])

    p_hist, p_header, p_keys, _ = _fit_with_loggers(
        lambda **kw: plain.fit(**kwargs, **kw), tmp_path, "plain")
    m_hist, m_header, m_keys, m_opted = _fit_with_loggers(
        lambda **kw: mirrored.fit(**kwargs, **kw), tmp_path, "mirrored")

    assert list(m_hist) == list(p_hist) == [
        "loss", "mae", "val_loss", "val_mae"]
    assert m_header == p_header == [
        "epoch", "loss", "mae", "val_loss", "val_mae"]
    assert m_keys == p_keys
    # The opt-in sees the vectors, and the epoch values per replica.
    assert m_opted == p_keys | set(_replica_stats.STAT_KEYS)
    assert mirrored.replica_history["samples"] == [[7, 7, 5, 4]] * 2


def test_wants_replica_logs_is_the_opt_in():
    assert not _replica_logs.wants_replica_logs(keras.callbacks.History())
    assert not _replica_logs.wants_replica_logs(_Recorder())
    assert _replica_logs.wants_replica_logs(_OptedIn())
    assert _replica_logs.wants_replica_logs(
        replica_history.ReplicaHistory(types.SimpleNamespace()))
    assert _replica_stats.strip(
        {"loss": 1, "replica_loss": 2, "val_replica_loss": 3,
         "val_loss": 4}) == {"loss": 1, "val_loss": 4}


def test_first_step_shows_one_tracing_line(cpus, capsys):
    x, y, _ = data(23)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    notice = ("\x1b[1m0/3\x1b[0m \x1b[37m" + "━" * 20 + "\x1b[0m "
              "tracing the training step (once per compile)")
    blank = "\r" + " " * (len(notice) - 17) + "\r"  # 17: escape codes
    mirrored.fit(x, y, batch_size=10, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert out.startswith(notice + blank)
    assert out.count(notice) == 1 and "3/3" in out
    # Traced already: the next fit shows the progress bar only.
    mirrored.fit(x, y, batch_size=10, epochs=1, verbose=1)
    assert "tracing" not in capsys.readouterr().out
    mirrored.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""
