"""`StepBackup`: step-granular backup and resume of `MirroredModel.fit`.

Keras's `BackupAndRestore` resumes at epoch starts and re-runs a partial
epoch, so a killed and restarted run does not end with the weights of an
uninterrupted one. `StepBackup` saves, every `every_n_steps` optimizer
steps and at every epoch end, the model's weights, the optimizer's
variables (its `iterations` included) and the position `(epoch, step in
epoch)`. When `MirroredModel.fit` is given a `StepBackup` whose directory
holds a backup, it restores them and resumes at that epoch, skipping the
batches that epoch already trained on, so the run ends with the same step
count and weights as an uninterrupted one.

Requirements: deterministic input, identical on every run (arrays with
`shuffle=False`, or a `tf.data.Dataset` without unseeded shuffling): the
skipped batches are the first `step` batches of the resumed epoch. Only the
chief writes (atomically: a temporary file renamed into place); every
worker reads the same file on resume, so with workers on several hosts the
directory must be on a shared file system. The backup is deleted when
`fit` completes (unless `delete_on_train_end=False`).

Preemption: while it is in `fit`, SIGTERM to any worker stops every worker
after the same step, with the backup written there, and exits with code 75
for a restart (see `keras_mirror._preemption`).
"""

import os

import keras
import numpy as np
import tensorflow as tf

from keras_mirror.distribute import _preemption

_FILE = "step_backup.npz"


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

    def __init__(self, backup_dir, every_n_steps=1,
                 delete_on_train_end=True):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(
                every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                "`every_n_steps` must be a positive integer. "
                f"Received: every_n_steps={every_n_steps!r}")
        self.backup_dir = str(backup_dir)
        self.every_n_steps = every_n_steps
        self.delete_on_train_end = delete_on_train_end
        self._epoch = 0
        self._offset = 0
        self._partial = False

    @property
    def path(self):
        return os.path.join(self.backup_dir, _FILE)

    # -- state -------------------------------------------------------------

    @staticmethod
    def _variables(mirrored):
        return (list(mirrored._inner.weights),
                list(mirrored.optimizer.variables))

    def _is_chief(self):
        return getattr(self.model, "is_chief", True)

    def save(self, epoch, step):
        """Writes the state after `step` batches of `epoch` (chief only)."""
        if not self._is_chief():
            return
        weights, opt_vars = self._variables(self.model)
        arrays = {f"w{i}": np.asarray(v.numpy())
                  for i, v in enumerate(weights)}
        arrays.update({f"o{i}": np.asarray(v.numpy())
                       for i, v in enumerate(opt_vars)})
        arrays["position"] = np.array([epoch, step], np.int64)
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = f"{self.path}.{os.getpid()}.tmp.npz"
        np.savez(temporary, **arrays)
        os.replace(temporary, self.path)

    def load(self, mirrored):
        """Restores a backup into `mirrored`; returns (epoch, step) or None."""
        if not os.path.exists(self.path):
            return None
        weights, opt_vars = self._variables(mirrored)
        with np.load(self.path) as f:
            w = [f[f"w{i}"] for i in range(len(weights))]
            o = [f[f"o{i}"] for i in range(len(opt_vars))]
            if sum(k.startswith("w") for k in f.files) != len(weights) or \
                    sum(k.startswith("o") for k in f.files) != len(opt_vars):
                raise ValueError(
                    "The backup does not match this model and optimizer. "
                    f"Received: backup_dir={self.backup_dir!r}")
            epoch, step = (int(v) for v in f["position"])
        with mirrored.strategy.scope():
            for v, value in zip(weights + opt_vars, w + o):
                v.assign(value)
        return epoch, step

    # -- callback ----------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._preemption = _preemption.Watch()  # SIGTERM: see _preemption

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations % self.every_n_steps == 0:
            self.save(self._epoch, self._offset + batch + 1)
        _preemption.after_step(self, getattr(self, "_preemption", None),
                               self._epoch, self._offset + batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._offset = 0
        self.save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if getattr(self, "_preemption", None) is not None:
            self._preemption.close()
        if self._partial or not self.delete_on_train_end:
            return
        if self._is_chief() and os.path.exists(self.path):
            os.remove(self.path)

    # -- resuming (called by MirroredModel.fit) ----------------------------

    def resume_fit(self, mirrored, fit, x, y, batch_size, epochs,
                   steps_per_epoch, kwargs, steps=None):
        """Runs `fit` from the backup's position, skipping done batches."""
        position = self.load(mirrored)
        initial_epoch = kwargs.pop("initial_epoch", 0)
        if position is None:
            return fit(x, y, batch_size=batch_size, epochs=epochs,
                       steps_per_epoch=steps_per_epoch,
                       initial_epoch=initial_epoch, **kwargs)
        epoch, step = position
        if steps is not None and step >= steps:
            epoch, step = epoch + 1, 0  # saved after an epoch's last batch
        print(f"keras-mirror: StepBackup resumes at epoch {epoch}, step "
              f"{step} (optimizer step "
              f"{int(mirrored.optimizer.iterations.numpy())}).", flush=True)
        first = None
        if step > 0 and epoch < epochs:
            skipped, sw_kwargs = _skip(x, y, kwargs, step, batch_size)
            self._offset, self._partial = step, True
            try:
                first = fit(*skipped, batch_size=batch_size,
                            epochs=epoch + 1, initial_epoch=epoch,
                            steps_per_epoch=(steps_per_epoch - step
                                             if steps_per_epoch else None),
                            **sw_kwargs)
            finally:
                self._offset, self._partial = 0, False
            epoch += 1
        if epoch >= epochs:
            self.on_train_end()
            return first
        rest = fit(x, y, batch_size=batch_size, epochs=epochs,
                   initial_epoch=epoch, steps_per_epoch=steps_per_epoch,
                   **kwargs)
        if first is not None:
            for k, v in first.history.items():
                rest.history[k] = list(v) + list(rest.history.get(k, []))
            rest.epoch = list(first.epoch) + list(rest.epoch)
        return rest


def _skip(x, y, kwargs, step, batch_size):
    """The input without its first `step` batches; (x, y), kwargs."""
    kwargs = dict(kwargs)
    if isinstance(x, tf.data.Dataset):
        return (x.skip(step), y), kwargs
    if isinstance(x, keras.utils.PyDataset):
        raise ValueError(
            "StepBackup cannot skip batches of a PyDataset yet; pass arrays "
            "or a tf.data.Dataset. Received: x=PyDataset")
    if kwargs.get("shuffle", True):
        raise ValueError(
            "StepBackup resumes inside an epoch by skipping its first "
            "batches, which needs the same batches on every run: pass "
            "`shuffle=False`. Received: shuffle=True")
    rows = step * (batch_size or 32)

    def cut(t):
        return None if t is None else tf.nest.map_structure(
            lambda a: a[rows:], t)

    if kwargs.get("sample_weight") is not None:
        kwargs["sample_weight"] = cut(kwargs["sample_weight"])
    return (cut(x), cut(y)), kwargs


def find(callbacks):
    """The `StepBackup` among `callbacks` (a list or CallbackList), or None."""
    items = getattr(callbacks, "callbacks", callbacks) or []
    found = [c for c in items if isinstance(c, StepBackup)]
    if len(found) > 1:
        raise ValueError("Pass at most one StepBackup callback to `fit`.")
    return found[0] if found else None
