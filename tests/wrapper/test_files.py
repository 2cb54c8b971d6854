"""Issue 23: hostile or broken files, full and read-only disks.

Each refusal is checked before anything is loaded or assigned: the model's
weights and optimizer state stay bit for bit as they were, and the same
`MirroredModel` trains afterwards (`test_error_paths.assert_untouched_and_
trains`). Full and read-only disks are real: small tmpfs mounts (root only;
skipped elsewhere), unmounted in a `finally`.
"""

import contextlib
import os
import subprocess
import tempfile
import zipfile

import keras
import numpy as np
import pytest
from support.refusals import X
from support.refusals import Y
from support.refusals import assert_untouched_and_trains
from support.refusals import state
from support.refusals import trained

import keras_mirror
from keras_mirror import errors
from keras_mirror import saving
from keras_mirror.callbacks import step_backup
from keras_mirror.callbacks.step_backup import StepBackup


@contextlib.contextmanager
def tmpfs(path, size="256k"):
    """A small tmpfs at `path` (root only), unmounted afterwards."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                           "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr!r}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(folder):
    """Fills the file system of `folder` to the last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


# -- 1. path traversal -------------------------------------------------------

@pytest.mark.parametrize("member", [
    "../../../../x/e.txt", "assets/../../../../x/e.txt", "/tmp/km_abs/e.txt",
    "assets\\..\\..\\..\\x\\e.txt"])
def test_archive_member_outside_the_archive_is_refused(tmp_path, member):
    path = tmp_path / "m.keras"
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]).save(path)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr(member, "escaped")
    with pytest.raises(errors.UnsafeModelError, match=(
            f"`filepath` holds the archive member '{_escaped(member)}', "
            r"whose name leaves the archive \(an absolute path or `..`\).*"
            f"Received: filepath='{path}'")):
        keras_mirror.load_model(path)
    assert not os.path.exists("/tmp/km_abs")
    assert not list(tmp_path.rglob("e.txt"))


def _escaped(text):
    import re

    return re.escape(repr(text)[1:-1])


def test_harmless_member_names_still_load(tmp_path):
    path = tmp_path / "m.keras"
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]).save(path)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("assets/./notes..txt", "fine")
    assert keras_mirror.load_model(path).output_shape == (None, 1)


# -- 2. load_weights all or nothing -------------------------------------------

def _other_weights(tmp_path, outputs):
    keras.utils.set_random_seed(7)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dense(outputs)])
    path = tmp_path / "other.weights.h5"
    other.save_weights(path)
    return path


def test_load_weights_whose_later_layers_do_not_fit_changes_nothing(
        cpus, tmp_path):
    mirrored, y = trained(cpus)
    path = _other_weights(tmp_path, outputs=2)  # first layer fits
    before = state(mirrored)
    with pytest.raises(ValueError, match=(
            r"`filepath` holds weights that do not fit this model: "
            r"'layers/dense_\d+/vars/0' has shape \(4, 2\) in the file and "
            r"\(4, 1\) in the model\. Nothing was loaded\..*"
            f"Received: filepath='{path}'")):
        mirrored.load_weights(path)
    assert_untouched_and_trains(mirrored, y, before)


def test_load_weights_restores_everything_if_keras_fails_late(
        cpus, tmp_path, monkeypatch):
    mirrored, y = trained(cpus)
    path = _other_weights(tmp_path, outputs=1)
    before = state(mirrored)
    original = keras.Model.load_weights

    def half_then_fail(model, *args, **kwargs):
        original(model, *args, **kwargs)
        raise RuntimeError("late failure")

    monkeypatch.setattr(keras.Model, "load_weights", half_then_fail)
    with pytest.raises(RuntimeError, match="late failure"):
        mirrored.load_weights(path)
    monkeypatch.undo()
    assert_untouched_and_trains(mirrored, y, before)
    mirrored.load_weights(path)  # a file that fits loads
    np.testing.assert_array_equal(mirrored.model.get_weights()[-1],
                                  keras.Sequential([
                                      keras.Input((3,)),
                                      keras.layers.Dense(4),
                                      keras.layers.Dense(1)]).get_weights()[
                                          -1] * 0 + _bias(path))


def _bias(path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dense(1)])
    model.load_weights(path)
    return model.get_weights()[-1]


# -- 3. and 4. the backup position and directory, before loading ------------

def _backup_then_step(cpus, backup_dir, position):
    """A backup of another state at `position`, then one more step."""
    mirrored, y = trained(cpus)
    writer = StepBackup(backup_dir)
    writer.set_model(mirrored)
    writer.save(*position)
    mirrored.fit(X, y, batch_size=8, verbose=0)
    return mirrored, y


def _resume(mirrored, backup_dir, epochs=2):
    mirrored.fit(X, Y, batch_size=2, epochs=epochs, shuffle=False,
                 verbose=0, callbacks=[StepBackup(backup_dir)])


@pytest.mark.parametrize("position,why", [
    ((-1, 3), r"the epoch must be in \[0, 2\] \(initial_epoch=0, "
              r"epochs=2\)"),
    ((0, -5), r"the step must be 0 or more, and 0 after the last epoch"),
    ((1, 9), r"epoch 1 has 4 step\(s\)"),
    ((2, 1), r"the step must be 0 or more, and 0 after the last epoch"),
    ((7, 0), r"the epoch must be in \[0, 2\] \(initial_epoch=0, "
             r"epochs=2\)"),
])
def test_impossible_backup_position_is_refused(cpus, tmp_path, position,
                                                why):
    mirrored, y = _backup_then_step(cpus, tmp_path, position)
    before = state(mirrored)
    path = tmp_path / "step_backup.npz"
    with pytest.raises(errors.StepBackupError, match=(
            f"The step backup '{path}' holds the position "
            rf"\[{position[0]}, {position[1]}\] \(epoch, step\), which "
            f"this run cannot reach: {why}. Nothing was restored.*"
            f"Received: backup_dir='{tmp_path}'")):
        _resume(mirrored, tmp_path)
    assert_untouched_and_trains(mirrored, y, before)


def test_possible_backup_positions_still_resume(cpus, tmp_path):
    mirrored, _ = _backup_then_step(cpus, tmp_path, (1, 0))
    _resume(mirrored, tmp_path)  # 1 epoch of 4 steps left
    assert int(mirrored.optimizer.iterations.numpy()) == 1 + 4
    assert not (tmp_path / "step_backup.npz").exists()


def test_read_only_backup_directory_is_refused_before_loading(cpus,
                                                              tmp_path):
    with tmpfs(tmp_path / "ro") as folder:
        mirrored, y = _backup_then_step(cpus, folder, (0, 2))
        subprocess.run(["mount", "-o", "remount,ro", str(folder)],
                       check=True)
        before = state(mirrored)
        with pytest.raises(errors.BackupDirectoryError, match=(
                f"StepBackup cannot write to its directory '{folder}' "
                r"\(OSError: Read-only file system\)")):
            _resume(mirrored, folder)
        assert_untouched_and_trains(mirrored, y, before)


# -- 5. a full disk ----------------------------------------------------------

@pytest.mark.parametrize("method,name", [
    ("save", "m.keras"), ("save_weights", "m.weights.h5")])
def test_full_disk_names_the_target_and_keeps_the_old_file(
        cpus, tmp_path, method, name, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with tmpfs(tmp_path / "full") as folder:
        mirrored, y = trained(cpus)
        target = folder / name
        getattr(mirrored, method)(target)
        saved = state(mirrored)[:len(mirrored.model.variables)]
        mirrored.fit(X, y, batch_size=8, verbose=0)
        _fill(folder)
        before = state(mirrored)
        with pytest.raises(OSError, match=(
                r"\[Errno 28\] Could not write `filepath` \(No space left "
                r"on device\); the file keeps its previous content.*"
                f"Received: filepath='{target}'")):
            getattr(mirrored, method)(target)
        assert sorted(p.name for p in folder.iterdir()) == [
            "filler", name]
        # No tmpXXXX/assets folder left (autograph's files may be there).
        assert [p for p in scratch.iterdir() if p.is_dir()] == []
        os.remove(folder / "filler")
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        if method == "save":
            model = keras.saving.load_model(target)
        else:
            model.load_weights(target)
        for a, b in zip(model.weights, saved):
            np.testing.assert_array_equal(a.numpy(), b)
        assert_untouched_and_trains(mirrored, y, before)


def test_full_disk_in_model_checkpoint_names_the_file(cpus, tmp_path):
    with tmpfs(tmp_path / "full") as folder:
        mirrored, y = trained(cpus)
        _fill(folder)
        target = folder / "ckpt.keras"
        with pytest.raises(OSError, match=(
                r"Could not write `filepath` \(No space left on device\).*"
                f"Received: filepath='{target}'")):
            mirrored.fit(X, y, batch_size=8, verbose=0, callbacks=[
                keras.callbacks.ModelCheckpoint(str(target))])


def test_keras_scratch_folders_go_next_to_the_file(tmp_path, monkeypatch):
    """A `.keras` save's `tmpXXXX/assets` is made beside the target, where
    the next save of that file removes what a killed save left."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    stale = tmp_path / ".m.keras.4242.scratch" / "tmpabc" / "assets"
    stale.mkdir(parents=True)
    seen = []

    def save(path, overwrite=True):
        seen.append(tempfile.mkdtemp())
        open(path, "wb").close()

    saving.write_atomically(save, tmp_path / "m.keras")
    assert os.path.dirname(os.path.dirname(seen[0])) == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.keras", "tmp"]
    assert list(scratch.iterdir()) == []
    assert tempfile.tempdir == str(scratch)


# -- 6. the step backup is synced -----------------------------------------

def test_step_backup_syncs_the_file_and_the_directory(cpus, tmp_path,
                                                      monkeypatch):
    mirrored, _ = trained(cpus)
    events = []
    fsync, replace = os.fsync, os.replace

    def logged_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def logged_replace(src, dst):
        events.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    backup = StepBackup(tmp_path)
    backup.set_model(mirrored)
    backup.save(0, 1)
    path = str(tmp_path / step_backup._FILE)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].startswith(path + ".") and \
        events[0][1].endswith(".tmp.npz")
    assert events[1:] == [("replace", path), ("fsync", str(tmp_path))]
