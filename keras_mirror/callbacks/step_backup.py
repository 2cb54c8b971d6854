"""`StepBackup`: step-granular backup and resume of `MirroredModel.fit`.

Keras's `BackupAndRestore` resumes at epoch starts and re-runs a partial
epoch, so a killed and restarted run does not end with the weights of an
uninterrupted one. `StepBackup` saves, every `every_n_steps` optimizer
steps and at every epoch end, the model's weights, the optimizer's
variables (its `iterations` included) and the position `(epoch, step in
epoch)`. The model's state includes every variable, not only its
weights: the seed generators' states too, so that `Dropout` and other
random layers draw the same numbers after a resume. When
`MirroredModel.fit` is given a `StepBackup` whose directory holds a backup,
it checks every field's shape and dtype (from its header, before its
data; a backup that is truncated, not a regular file or does not fit raises
`StepBackupError` naming the file and field, nothing assigned), restores
it and resumes at that position on the batches an uninterrupted run would
read from there (`validation_split` and `steps_per_epoch` included, see
`keras_mirror.callbacks._resume`), so the run ends
with the same step count and weights as an uninterrupted one.

At `on_train_begin` the directory is created and checked with a probe
file and its free space (an unwritable or full directory raises
`BackupDirectoryError` naming it before the first step), and temporary
files left by a writer killed mid-write are removed.

Requirements: deterministic input, identical on every run (arrays or a
`keras.utils.PyDataset` with `shuffle=False`, or a `tf.data.Dataset`
without unseeded shuffling): the batches already trained on are skipped.
A Python generator cannot be skipped and resumes only at epoch starts. Only the
chief writes (atomically: a temporary file renamed into place); every
worker reads the same file on resume, so with workers on several hosts the
directory must be on a shared file system. The backup is deleted when
`fit` completes (unless `delete_on_train_end=False`; `fit` given a
finished backup trains nothing and returns an empty `History`).

Preemption: while it is in `fit`, SIGTERM to any worker stops every worker
after the same step, with the backup written there, and exits with code 75
for a restart (see `keras_mirror._preemption`).
"""

import errno
import os
import zipfile
import zlib

import keras
import numpy as np

from keras_mirror import errors
from keras_mirror.callbacks import _backup_fields
from keras_mirror.callbacks import _resume
from keras_mirror.distribute import _files
from keras_mirror.distribute import _homes
from keras_mirror.distribute import _preemption
from keras_mirror.distribute import _virtual_shards

_FILE = "step_backup.npz"
_TMP_SUFFIX = ".tmp.npz"


class StepBackup(keras.callbacks.Callback):
    """Backs up training state every `every_n_steps` steps; see module doc.

    Args:
        backup_dir: str or path. Directory of the backup (created).
        every_n_steps: int. Save after every this many optimizer steps (and
            at every epoch end); default 1.
        delete_on_train_end: bool. Delete the backup when `fit` completes;
            default True.

    Example:

    ```python
    mirrored.fit(x, y, batch_size=64, epochs=3, shuffle=False,
                 callbacks=[keras_mirror.StepBackup("backup/")])
    ```
    """

    _wants_wrapper = True  # reads the wrapper's state (`_user_model`)

    def __init__(self, backup_dir, every_n_steps=1,
                 delete_on_train_end=True):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(
                every_n_steps, (int, np.integer)) or every_n_steps < 1:
            raise ValueError(
                "`every_n_steps` must be a positive integer. "
                f"Received: every_n_steps={every_n_steps!r}")
        if not isinstance(backup_dir, (str, os.PathLike)) or \
                not os.fspath(backup_dir):
            raise ValueError(
                "`backup_dir` must be a non-empty path. "
                f"Received: backup_dir={backup_dir!r}")
        if not isinstance(delete_on_train_end, bool):
            raise ValueError(
                "`delete_on_train_end` must be True or False. "
                f"Received: delete_on_train_end={delete_on_train_end!r}")
        self.backup_dir = os.fspath(backup_dir)
        self.every_n_steps = int(every_n_steps)
        self.delete_on_train_end = delete_on_train_end
        self._epoch = 0
        self._offset = 0
        self._partial = False
        self._checked = False
        self._in_mirrored_fit = False  # set by `resume_fit` only

    @property
    def path(self):
        return os.path.join(self.backup_dir, _FILE)

    # -- state -------------------------------------------------------------

    @staticmethod
    def _variables(mirrored):
        """Every variable a step changes: the model's (weights and seed
        generators' states, so that Dropout resumes exactly) and its
        optimizers' (`iterations` included; a GAN's two optimizers too)."""
        model = mirrored.model
        optimizers = [mirrored.optimizer] + _homes.optimizers_of(model)
        return (_homes.unique(model.variables),
                _homes.unique([v for opt in optimizers if opt is not None
                         for v in opt.variables]))

    def _is_chief(self):
        return getattr(self.model, "is_chief", True)

    def save(self, epoch, step):
        """Writes the state after `step` batches of `epoch` (chief only).

        Atomic and durable: a temporary file in the backup directory,
        synced to disk (`fsync`), renamed over the backup, then the
        directory synced, so that a kill or a power cut at any moment
        leaves the previous backup or the new one.
        """
        if not self._is_chief():
            return
        model_vars, opt_vars = self._variables(self.model)
        arrays = {f"w{i}": np.asarray(v.numpy())
                  for i, v in enumerate(model_vars)}
        arrays.update({f"o{i}": np.asarray(v.numpy())
                       for i, v in enumerate(opt_vars)})
        arrays["position"] = np.array([epoch, step], np.int64)
        arrays.update(_virtual_shards.backup_arrays(self.model, step))
        temporary = f"{self.path}.{os.getpid()}{_TMP_SUFFIX}"
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
            with _backup_fields.create_new(temporary) as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        except OSError as e:
            _remove_quietly(temporary)
            raise self._directory_error(e) from e
        _files.fsync(self.backup_dir)  # the rename itself

    def _read(self, variables):
        """The backup's fields, checked (`_backup_fields.read`)."""
        try:
            return _backup_fields.read(
                self.path, _backup_fields.fields_of(*variables),
                self._mismatch,
                optional=_virtual_shards.BACKUP_FIELDS,
                first_check=lambda keys: _backup_fields.check_counts(
                    keys, *variables, self._mismatch))
        except errors.StepBackupError:
            raise
        except (OSError, ValueError, EOFError, KeyError,
                zipfile.BadZipFile, zlib.error) as e:
            raise errors.StepBackupError(
                f"The step backup {self.path!r} cannot be read "
                f"({type(e).__name__}: {e}); it is truncated or corrupt. "
                "Delete it to train from the start (or from your last "
                "checkpoint), or pass another `backup_dir`. "
                f"Received: backup_dir={self.backup_dir!r}") from None

    def _mismatch(self, detail):
        return errors.StepBackupError(
            f"The step backup {self.path!r} does not match this model and "
            f"optimizer: {detail}. Nothing was restored. Delete it (or pass "
            "another `backup_dir`) to train this model from the start. "
            f"Received: backup_dir={self.backup_dir!r}")

    def load(self, mirrored):
        """Restores a backup into `mirrored`; returns (epoch, step) or None.

        Reads and checks the whole backup before assigning any variable: a
        backup that is unreadable or does not fit changes nothing.
        """
        checked = self._read_checked(mirrored)
        if checked is None:
            return None
        return self._assign(mirrored, *checked)

    def _read_checked(self, mirrored):
        """(arrays, variables) of a backup that fits, or None if absent."""
        if not os.path.lexists(self.path):
            return None
        variables = self._variables(mirrored)
        arrays = self._read(variables)
        _virtual_shards.check_backup(mirrored, arrays, self.path,
                                     int(arrays["position"][1]))
        return arrays, variables

    def _assign(self, mirrored, arrays, variables):
        values = [arrays[f"w{i}"] for i in range(len(variables[0]))] + \
            [arrays[f"o{i}"] for i in range(len(variables[1]))]
        with mirrored.strategy.scope():
            for v, value in zip(variables[0] + variables[1], values):
                v.assign(value)
        return tuple(int(v) for v in arrays["position"])

    def _impossible(self, position, why):
        return errors.StepBackupError(
            f"The step backup {self.path!r} holds the position "
            f"{np.asarray(position).tolist()!r} (epoch, step), which this "
            f"run cannot reach: {why}. Nothing was restored. Delete it (or "
            "pass another `backup_dir`) to train from the start. "
            f"Received: backup_dir={self.backup_dir!r}")

    # -- the directory -----------------------------------------------------

    def _directory_error(self, e):
        return errors.BackupDirectoryError(
            f"StepBackup cannot write to its directory {self.backup_dir!r} "
            f"({type(e).__name__}: {e.strerror or e}). Pass a writable "
            "`backup_dir` with free space for one backup. "
            f"Received: backup_dir={self.backup_dir!r}")

    def check_directory(self, mirrored=None):
        """Creates the directory, removes stale temporary files of killed
        writers, writes a probe file and checks that one backup fits in the
        free space (chief only)."""
        mirrored = self.model if mirrored is None else mirrored
        if not getattr(mirrored, "is_chief", True):
            return
        probe = os.path.join(self.backup_dir,
                             f".probe.{os.getpid()}{_TMP_SUFFIX}")
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
            for name in os.listdir(self.backup_dir):
                if name.startswith(_FILE + ".") and \
                        name.endswith(_TMP_SUFFIX):
                    os.remove(os.path.join(self.backup_dir, name))
            with _backup_fields.create_new(probe) as f:
                f.write(b"\0")
                f.flush()
                os.fsync(f.fileno())
            self._check_free_space(mirrored)
        except OSError as e:
            raise self._directory_error(e) from e
        finally:
            _remove_quietly(probe)

    def _check_free_space(self, mirrored):
        needed = sum(v.numpy().nbytes for group in self._variables(
            mirrored) for v in group)
        stat = os.statvfs(self.backup_dir)
        free = stat.f_bavail * stat.f_frsize
        if free < needed:
            raise OSError(errno.ENOSPC, f"{free} bytes free, one backup "
                          f"needs about {needed}")

    # -- callback ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self._in_mirrored_fit:  # resuming needs the wrapper's fit
            raise _backup_fields.needs_mirrored_fit(self.model)
        if not self._checked:
            self.check_directory()
            self._checked = True
        self.watch_signals()

    def watch_signals(self):
        """Catches SIGTERM from now to the end of `fit` (see `_preemption`):
        `MirroredModel.fit` calls it before it reads or builds anything, so
        a SIGTERM while the input is prepared or the model built is kept
        and acted on after the first step."""
        if getattr(self, "_preemption", None) is None:
            self._preemption = _preemption.Watch()

    def stop_watching(self):
        if getattr(self, "_preemption", None) is not None:
            self._preemption.close()
            self._preemption = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        iterations = _iterations(self.model)
        if iterations % self.every_n_steps == 0:
            self.save(self._epoch, self._offset + batch + 1)
        _preemption.after_step(self, getattr(self, "_preemption", None),
                               self._epoch, self._offset + batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._offset = 0
        self.save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self._partial:  # more of the resumed run follows
            return
        # A SIGTERM after the last step (in the last epoch's end, while its
        # backup is written) still stops every worker, the backup kept.
        _preemption.at_train_end(self, getattr(self, "_preemption", None))
        self.stop_watching()
        if not self.delete_on_train_end:
            return
        if self._is_chief() and os.path.exists(self.path):
            os.remove(self.path)

    # -- resuming (called by MirroredModel.fit) ----------------------------

    def resume_fit(self, mirrored, fit, x, y, batch_size, epochs,
                   steps_per_epoch, kwargs, steps=None):
        """Runs `fit` from the backup's position, on the batches an
        uninterrupted run would read from there (see `_resume`)."""
        self._in_mirrored_fit = True
        try:
            return self._resume_fit(mirrored, fit, x, y, batch_size, epochs,
                                    steps_per_epoch, kwargs)
        finally:
            self._in_mirrored_fit = False

    def _resume_fit(self, mirrored, fit, x, y, batch_size, epochs,
                    steps_per_epoch, kwargs):
        # The directory and the whole backup are checked before anything
        # is assigned: a refusal leaves the model and optimizer as they were.
        self.check_directory(mirrored)
        self._checked = True
        checked = self._read_checked(mirrored)
        kwargs = dict(kwargs)
        initial_epoch = kwargs.pop("initial_epoch", 0)
        if checked is None:
            return fit(x, y, batch_size=batch_size, epochs=epochs,
                       steps_per_epoch=steps_per_epoch,
                       initial_epoch=initial_epoch, **kwargs)
        x, y, kwargs = _resume.split_validation(x, y, kwargs)
        batches = _resume.num_batches(x, batch_size)
        why = _resume.impossible_position(
            checked[0]["position"], epochs, initial_epoch, steps_per_epoch,
            batches)
        if why:
            raise self._impossible(checked[0]["position"], why)
        position = self._assign(mirrored, *checked)
        segments = _resume.plan(position, epochs, initial_epoch,
                                steps_per_epoch, batches)
        print(f"keras-mirror: StepBackup resumes at epoch {position[0]}, "
              f"step {position[1]} (optimizer step "
              f"{_iterations(mirrored)}).", flush=True)
        history = None
        for i, segment in enumerate(segments):
            history = _resume.merge(history, self._run_segment(
                fit, segment, x, y, batch_size, kwargs, position,
                last=i == len(segments) - 1))
        if history is None:  # the backup is of a finished run
            self.on_train_end()
            history = keras.callbacks.History()
            history.set_model(mirrored)
        return history

    def _run_segment(self, fit, segment, x, y, batch_size, kwargs, position,
                     last):
        sx, sy, skw = _resume.skip(x, y, kwargs, segment.skip, batch_size)
        first = segment.first_epoch == position[0] and position[1] > 0
        self._offset = position[1] if first else 0
        self._partial = not last
        try:
            return fit(sx, sy, batch_size=batch_size,
                       epochs=segment.end_epoch,
                       initial_epoch=segment.first_epoch,
                       steps_per_epoch=segment.steps_per_epoch, **skw)
        finally:
            self._offset, self._partial = 0, False


def _iterations(mirrored):
    """Optimizer steps taken: the first optimizer's `iterations` (a model
    with its own `train_step` may hold its optimizers as attributes)."""
    optimizers = [mirrored.optimizer] + _homes.optimizers_of(mirrored.model)
    for optimizer in optimizers:
        if optimizer is not None:
            return int(optimizer.iterations.numpy())
    return 0


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def find(callbacks):
    """The `StepBackup` among `callbacks` (a list or CallbackList), or None."""
    items = getattr(callbacks, "callbacks", callbacks) or []
    found = [c for c in items if isinstance(c, StepBackup)]
    if len(found) > 1:
        raise ValueError("Pass at most one StepBackup callback to `fit`.")
    return found[0] if found else None
