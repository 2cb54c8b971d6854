"""Callbacks see the user's own model, as in plain `fit`.

During `mirrored.fit`, `evaluate` and `predict`, a callback's `self.model` is
the user's model object (`mirrored.model`), not the wrapper: so
`self.model.get_layer("lstm")`, `self.model.layers`, `get_weights` /
`set_weights`, `self.model.optimizer`, `self.model.generator` and every
other attribute of the user's class behave exactly as in plain Keras, with
the live weights. Keras does the same for torch's `DistributedDataParallel`
wrapper (`keras.callbacks.Callback.model` returns `self._model.module`).

What a callback writes on the model must reach the loop that the wrapper
runs, so `UserModelState` makes three of the wrapper's attributes the user
model's own:

- `stop_training` (`EarlyStopping`, `TerminateOnNaN`): Keras's `fit` loop
  reads the wrapper's, which is the user model's;
- `history` (`History` sets `model.history`; `fit` returns the wrapper's);
- `_initial_epoch` (`BackupAndRestore` sets it on the model to resume).

And during a wrapper call, `saves_through` routes the user model's `save`
and `save_weights` through the wrapper's (`ModelCheckpoint`,
`BackupAndRestore`, a callback's own `self.model.save(...)`): the same files
plain Keras writes, loadable without keras-mirror, written atomically, and
on the chief only in a multi-worker run.

keras-mirror's own callbacks (`ReplicaHistory`, `ReplicaTensorBoard`,
`StepBackup`) read the wrapper's replicas and step counter; they set
`_wants_wrapper = True` and get the wrapper.
"""

import contextlib
import functools

from keras_mirror import _compat
from keras_mirror.distribute import _files


def _forwarded(name):
    """A property kept on the user's model once the wrapper holds it."""

    def get(self):
        inner = self.__dict__.get("_inner")
        if inner is None:
            return self.__dict__.get("_own_" + name)
        return getattr(inner, name, None)

    def set_(self, value):
        inner = self.__dict__.get("_inner")
        if inner is None:  # Keras's own `__init__`, before the wrap
            self.__dict__["_own_" + name] = value
        else:
            setattr(inner, name, value)

    return property(get, set_, doc=f"The wrapped model's `{name}`.")


class UserModelState:
    """Mixin of `MirroredModel`: state shared with the user's model."""

    stop_training = _forwarded("stop_training")
    history = _forwarded("history")
    _initial_epoch = _forwarded(_compat.INITIAL_EPOCH)


def _routed(mirrored, method, original):
    """`original` (the model's own method); for `.keras` / `.weights.h5`
    paths as the wrapper writes them: atomically, on the chief only."""
    suffix = ".keras" if method == "save" else ".weights.h5"

    @functools.wraps(original)
    def call(filepath, overwrite=True, **kwargs):
        if not str(filepath).endswith(suffix):
            return original(filepath, overwrite=overwrite, **kwargs)
        if not mirrored.is_chief:
            return None  # Only the chief writes; saving has no collective.
        return _files.write_atomically(original, str(filepath), overwrite,
                                       **kwargs)

    return call


@contextlib.contextmanager
def saves_through(mirrored):
    """Within the block, the user's model saves as the wrapper does.

    Instance attributes shadow the class's `save` and `save_weights` for the
    duration of the call (re-entrant) and are removed afterwards; they call
    the class's own methods (`type(model).save`), as the wrapper does.
    """
    model = mirrored._inner
    if "save" in vars(model):  # an outer wrapper call routes already
        yield
        return
    for method in ("save", "save_weights"):
        original = getattr(type(model), method).__get__(model)
        # Not a tracked Keras attribute: a plain function on the instance.
        object.__setattr__(model, method,
                           _routed(mirrored, method, original))
    try:
        yield
    finally:
        for method in ("save", "save_weights"):
            object.__delattr__(model, method)
