"""Step-granular backup and resume (`StepBackup`), in process and after a
worker of a real 2-worker run is SIGKILLed mid-epoch and the launcher
restarts the group.

Also the tests of `keras_mirror/callbacks/_resume.py`.
"""

import json
import os
import re
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from support import guide_models
from support.helpers import data
from support.helpers import max_diff
from support.helpers import mlp
from support.multi_worker import WORKER
from support.multi_worker import assert_equal_single_device
from support.multi_worker import no_leftover_processes  # noqa: F401

import keras_mirror
from keras_mirror import errors
from keras_mirror import launch as launch_lib
from keras_mirror.callbacks.step_backup import StepBackup


class _Crash(Exception):
    pass


class _CrashAt(keras.callbacks.Callback):
    """Raises after the `step`-th training step of a fresh run."""

    def __init__(self, step):
        super().__init__()
        self.step = step
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise _Crash()


def _fit(cpus, backup_dir, crash_at=None, every_n_steps=1):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y, sw = data(45)
    callbacks = [StepBackup(backup_dir, every_n_steps=every_n_steps)]
    if crash_at is not None:
        callbacks.append(_CrashAt(crash_at))
    mirrored.fit(x, y, sample_weight=sw, batch_size=8, epochs=3,
                 shuffle=False, verbose=0, callbacks=callbacks)
    return mirrored


@pytest.mark.timeout(90)
@pytest.mark.parametrize("crash_at,every", [(8, 1), (9, 2), (6, 1)])
def test_resume_mid_epoch_equals_uninterrupted(cpus, tmp_path, crash_at,
                                               every):
    reference = mlp()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y, sw = data(45)
    reference.fit(x, y, sample_weight=sw, batch_size=8, epochs=3,
                  shuffle=False, verbose=0)
    with pytest.raises(_Crash):
        _fit(cpus, tmp_path, crash_at=crash_at, every_n_steps=every)
    assert (tmp_path / "step_backup.npz").exists()
    resumed = _fit(cpus, tmp_path)
    assert int(resumed.optimizer.iterations.numpy()) == 18
    assert max_diff(reference.get_weights(),
                    resumed.model.get_weights()) < 1e-5
    assert not (tmp_path / "step_backup.npz").exists()


def test_shuffle_true_is_refused_on_mid_epoch_resume(cpus, tmp_path):
    with pytest.raises(_Crash):
        _fit(cpus, tmp_path, crash_at=3)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="adam", loss="mse")
    x, y, _ = data(45)
    with pytest.raises(ValueError, match="shuffle=False"):
        mirrored.fit(x, y, batch_size=8, epochs=3, verbose=0,
                     callbacks=[StepBackup(tmp_path)])


@pytest.mark.xdist_group("processes")
@pytest.mark.timeout(150)
def test_sigkilled_worker_resumes_to_uninterrupted_weights(tmp_path, capsys):
    backup = tmp_path / "backup"
    code = launch_lib.launch(
        [sys.executable, str(WORKER), str(tmp_path), "--epochs", "2",
         "--backup", str(backup), "--kill-at-step", "8"], 2,
        max_restarts=1, timeout=140, start_timeout=60, grace_period=2)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "killing myself after step 8" in out
    assert "StepBackup resumes at epoch 1, step" in out
    gap = assert_equal_single_device(tmp_path)
    infos = [json.loads((tmp_path / f"info_{i}.json").read_text())
             for i in (0, 1)]
    assert [i["attempt"] for i in infos] == [1, 1]
    print(f"after SIGKILL + restart: max |w - w_single| = "
          f"{gap:.3g}")


# -- issue 16, defect 1: resume where Keras's own iterator would be -------

def _dropout_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(3),
    ])


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, sw):
        super().__init__()
        self.parts = x, y, sw

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return tuple(p[i * 8:(i + 1) * 8] for p in self.parts)


def _inputs(kind):
    x, y, sw = data(45)
    if kind == "pydataset":
        return dict(x=_Batches(x, y, sw), shuffle=False)
    if kind == "arrays":
        return dict(x=x, y=y, sample_weight=sw, batch_size=8, shuffle=False)
    ds = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(8)
    return dict(x=ds.repeat() if kind == "repeated" else ds)


def _mirrored_fit(cpus, fit_kwargs, backup_dir=None, crash_at=None,
                  build=mlp):
    mirrored = keras_mirror.MirroredModel(build(), devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    callbacks = []
    if backup_dir is not None:
        callbacks.append(StepBackup(backup_dir))
    if crash_at is not None:
        callbacks.append(_CrashAt(crash_at))
    history = mirrored.fit(verbose=0, callbacks=callbacks, **fit_kwargs)
    return mirrored, history


def _plain_fit(fit_kwargs, build=mlp):
    """One device, uninterrupted (as fast to trace as a model can be)."""
    model = build()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(verbose=0, **fit_kwargs)
    return model


def _interrupted_equals_uninterrupted(cpus, tmp_path, fit_kwargs, crash_at,
                                      build=mlp, mirrored_reference=False):
    """A run crashed after step `crash_at` and resumed from its backup ends
    where an uninterrupted run does: one device's (exact, as everywhere in
    keras-mirror), or, with `mirrored_reference`, a `MirroredModel`'s."""
    if mirrored_reference:
        reference, _ = _mirrored_fit(cpus, fit_kwargs, build=build)
        weights = reference.model.get_weights()
    else:
        reference = _plain_fit(fit_kwargs, build)
        weights = reference.get_weights()
    iterations = int(reference.optimizer.iterations.numpy())
    keras.backend.clear_session()
    with pytest.raises(_Crash):
        _mirrored_fit(cpus, fit_kwargs, tmp_path, crash_at, build=build)
    keras.backend.clear_session()
    resumed, history = _mirrored_fit(cpus, fit_kwargs, tmp_path, build=build)
    assert int(resumed.optimizer.iterations.numpy()) == iterations
    assert max_diff(weights, resumed.model.get_weights()) < 1e-5
    return history


@pytest.mark.timeout(90)
def test_resume_with_validation_split(cpus, tmp_path):
    # 36 training rows: 5 steps an epoch; the crash is in epoch 1.
    fit_kwargs = dict(_inputs("arrays"), epochs=2, validation_split=0.2)
    history = _interrupted_equals_uninterrupted(cpus, tmp_path, fit_kwargs,
                                                crash_at=6)
    assert len(history.history["val_loss"]) == 1  # the resumed epoch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,crash_at", [
    ("arrays", 2), ("arrays", 5), ("finite", 2), ("repeated", 6),
    ("pydataset", 5)])
def test_resume_with_steps_per_epoch_below_the_data(cpus, tmp_path, kind,
                                                    crash_at):
    # 6 batches, 4 steps an epoch: Keras carries its iterator across
    # epochs (epoch 1 reads batches 4-5 of a finite input, 4-7 of a
    # repeated one).
    fit_kwargs = dict(_inputs(kind), epochs=3, steps_per_epoch=4)
    _interrupted_equals_uninterrupted(cpus, tmp_path, fit_kwargs, crash_at)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("execution")
def test_resume_with_dropout_restores_seed_generators(cpus, tmp_path):
    fit_kwargs = dict(_inputs("arrays"), epochs=2)
    _interrupted_equals_uninterrupted(cpus, tmp_path, fit_kwargs, crash_at=4,
                                      build=_dropout_mlp,
                                      mirrored_reference=True)


# -- issue 16, defects 4-6: bad backups, bad directories, finished runs ----

def _weights(mirrored):
    return [w.copy() for w in mirrored.model.get_weights()]


def _wide_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                             keras.layers.Dense(3)])


def test_backup_of_other_shapes_assigns_nothing(cpus, tmp_path):
    fit_kwargs = dict(_inputs("arrays"), epochs=1)
    with pytest.raises(_Crash):
        _mirrored_fit(cpus, fit_kwargs, tmp_path, crash_at=2)
    mirrored = keras_mirror.MirroredModel(_wide_mlp(), devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    mirrored.build((None, 6))
    before = _weights(mirrored)
    path = str(tmp_path / "step_backup.npz")
    with pytest.raises(
            errors.StepBackupError,
            match=re.escape(
                f"The step backup '{path}' does not match this model and "
                "optimizer: field 'w0' (variable 'sequential_1/dense_2/"
                "kernel') must have shape (6, 8) and dtype float32. "
                "Received: w0 of shape (6, 16) and dtype float32. Nothing "
                "was restored.")):
        mirrored.fit(verbose=0, callbacks=[StepBackup(tmp_path)],
                     **fit_kwargs)
    assert max_diff(before, _weights(mirrored)) == 0.0
    assert int(mirrored.optimizer.iterations.numpy()) == 0


def test_truncated_backup_names_the_file_and_the_fix(cpus, tmp_path):
    fit_kwargs = dict(_inputs("arrays"), epochs=1)
    with pytest.raises(_Crash):
        _mirrored_fit(cpus, fit_kwargs, tmp_path, crash_at=2)
    path = tmp_path / "step_backup.npz"
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(
            errors.StepBackupError,
            match=f"The step backup '{path}' cannot be read .* it is "
                  "truncated or corrupt. Delete it to train from the start"):
        _mirrored_fit(cpus, fit_kwargs, tmp_path)


def test_leftover_temporary_files_are_removed_on_start(cpus, tmp_path):
    stale = tmp_path / "step_backup.npz.4242.tmp.npz"
    stale.write_bytes(b"half a backup")
    mine = tmp_path / "notes.txt"
    mine.write_text("kept")
    _mirrored_fit(cpus, dict(_inputs("arrays"), epochs=1), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_unusable_backup_dir_fails_before_the_first_step(cpus, tmp_path):
    (tmp_path / "a_file").write_text("")
    backup_dir = tmp_path / "a_file" / "backup"
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="adam", loss="mse")
    with pytest.raises(
            errors.BackupDirectoryError,
            match=f"StepBackup cannot write to its directory "
                  f"'{backup_dir}' \\(NotADirectoryError: Not a directory\\)."
                  " Pass a writable `backup_dir`"):
        mirrored.fit(verbose=0, callbacks=[StepBackup(backup_dir)],
                     epochs=1, **_inputs("arrays"))
    assert int(mirrored.optimizer.iterations.numpy()) == 0


def test_fit_on_a_finished_backup_returns_a_history(cpus, tmp_path):
    fit_kwargs = dict(_inputs("arrays"), epochs=2)
    mirrored, _ = _mirrored_fit(cpus, fit_kwargs)
    callbacks = [StepBackup(tmp_path, delete_on_train_end=False)]
    mirrored.fit(verbose=0, callbacks=callbacks, **fit_kwargs)
    assert (tmp_path / "step_backup.npz").exists()
    again = mirrored.fit(verbose=0, callbacks=callbacks, **fit_kwargs)
    assert isinstance(again, keras.callbacks.History)
    assert again.history == {}
    assert int(mirrored.optimizer.iterations.numpy()) == 24


def test_full_backup_dir_fails_before_the_first_step(cpus, tmp_path,
                                                     monkeypatch):
    def almost_full(path):
        return types.SimpleNamespace(f_bavail=100, f_frsize=1)

    monkeypatch.setattr(os, "statvfs", almost_full)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="adam", loss="mse")
    with pytest.raises(
            errors.BackupDirectoryError,
            match=f"StepBackup cannot write to its directory '{tmp_path}' "
                  r"\(OSError: 100 bytes free, one backup needs about "
                  r"\d+\)"):
        mirrored.fit(verbose=0, callbacks=[StepBackup(tmp_path)],
                     epochs=1, **_inputs("arrays"))
    assert int(mirrored.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(backup_dir=None), "`backup_dir` must be a non-empty path. "
                            "Received: backup_dir=None"),
    (dict(backup_dir="b", every_n_steps=0),
     "`every_n_steps` must be a positive integer. Received: every_n_steps=0"),
    (dict(backup_dir="b", delete_on_train_end="yes"),
     "`delete_on_train_end` must be True or False. "
     "Received: delete_on_train_end='yes'"),
])
def test_step_backup_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StepBackup(**kwargs)
    assert StepBackup("b", every_n_steps=np.int64(3)).every_n_steps == 3


@pytest.mark.timeout(120)
def test_resume_of_a_gan_with_two_optimizers(cpus, tmp_path):
    """A model with its own `train_step`, two optimizers and a seed
    generator drawing its latent vectors resumes to one device's
    uninterrupted run."""

    def run(backup_dir=None, crash_at=None, wrap=True):
        model, compile_kwargs, (x, _) = guide_models.gan()
        target = keras_mirror.MirroredModel(model, devices=cpus) if wrap \
            else model
        target.compile(**compile_kwargs)
        callbacks = [StepBackup(backup_dir)] if backup_dir else []
        if crash_at is not None:
            callbacks.append(_CrashAt(crash_at))
        target.fit(x, batch_size=8, epochs=2, shuffle=False, verbose=0,
                   callbacks=callbacks)
        return model

    keras.utils.set_random_seed(0)
    reference = run(wrap=False).get_weights()
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    with pytest.raises(_Crash):
        run(tmp_path, crash_at=5)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    resumed = run(tmp_path)
    assert max_diff(reference, resumed.get_weights()) < 1e-5
