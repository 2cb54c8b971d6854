"""Routing per-replica vectors through Keras callbacks.

`train_step` returns, beside the usual global keys, vectors of length
`num_replicas` under the keys `replica_*` (and `val_replica_*` after
validation). A project that only adds the wrap must see the logs it saw
before: `ReplicaCallbackList` hands every callback the logs without the
vectors (so `History`, `CSVLogger`, `ProgbarLogger`, Keras's `TensorBoard`
and the user's own callbacks get exactly plain Keras's keys), except the
callbacks that opt in with the class attribute `wants_replica_logs = True`:
`ReplicaHistory`, `ReplicaTensorBoard`, and any user callback that sets it.
"""

import re
import sys
import weakref

import keras
import numpy as np

from keras_mirror.steps import _replica_stats


def wants_replica_logs(callback):
    """Whether `callback` opted in to the per-replica vectors.

    A callback opts in with a true class (or instance) attribute
    `wants_replica_logs`; every other callback sees plain Keras's logs.
    """
    return bool(getattr(callback, "wants_replica_logs", False))


def callback_model(callback, mirrored):
    """The model `callback` sees: the user's, or keras-mirror's wrapper."""
    if getattr(callback, "_wants_wrapper", False):
        return mirrored
    inner = mirrored.__dict__.get("_inner")
    return mirrored if inner is None else inner


class ReplicaCallbackList(keras.callbacks.CallbackList):
    """A `CallbackList` that gives the replica vectors only to opted-in ones.

    Callbacks with `wants_replica_logs = True` get the logs with the
    `replica_*` vectors; all others (`History`, `CSVLogger`, the progress
    bar, Keras's `TensorBoard`, yours by default) get the logs plain Keras
    would give them.
    """

    _notice = ""  # the first-step line on screen, if any
    _first_step = False  # until the first step of a `fit` ends

    def set_model(self, model):
        """Each callback gets the user's model, as in plain `fit`.

        The list itself keeps the wrapper (Keras's loop reads it);
        keras-mirror's own callbacks get it too
        (`_replica_logs.callback_model`).
        """
        if not model:
            return
        keras.callbacks.Callback.set_model(self, model)
        if self._history:
            model.history = self._history
        for callback in self.callbacks:
            callback.set_model(callback_model(callback, model))

    def _dispatch(self, hook, *args, logs=None):
        stripped = None
        for callback in self.callbacks:
            if wants_replica_logs(callback):
                cb_logs = logs
            else:
                if stripped is None:
                    stripped = _replica_stats.strip(logs)
                cb_logs = stripped
            # As Keras's `CallbackList` calls each hook: the batch hooks
            # with `logs=`, the others positionally (a callback may name
            # that parameter otherwise: `on_epoch_end(self, epoch, log)`).
            if "_batch_" in hook:
                getattr(callback, hook)(*args, logs=cb_logs)
            else:
                getattr(callback, hook)(*args, cb_logs)

    def on_train_begin(self, logs=None):
        self._first_step = True
        super().on_train_begin(logs)

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if self._first_step and not self._notice:
            self._notice = first_step_notice(self.callbacks, self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self._first_step:
            self._first_step = False
            if self._notice:
                _erase(self._notice)
                self._notice = ""
            function = getattr(self.model, "train_function", None)
            if function is not None:
                _TRACED[self.model] = weakref.ref(function)
        self._dispatch("on_train_batch_end", batch, logs=_numpy(logs))

    def on_test_batch_end(self, batch, logs=None):
        self._dispatch("on_test_batch_end", batch, logs=_numpy(logs))

    def on_predict_batch_end(self, batch, logs=None):
        self._dispatch("on_predict_batch_end", batch, logs=logs)

    def on_epoch_end(self, epoch, logs=None):
        self._dispatch("on_epoch_end", epoch, logs=_numpy(logs))

    def on_test_end(self, logs=None):
        self._dispatch("on_test_end", logs=_numpy(logs))

    def on_train_end(self, logs=None):
        self._dispatch("on_train_end", logs=_numpy(logs))


# model -> weak reference to the train function whose first step ran.
_TRACED = weakref.WeakKeyDictionary()
NOTICE = "tracing the training step (once per compile)"


def first_step_notice(callbacks, model):
    """Shows one progress-bar line while the first step traces, or "".

    The first step of a new train function traces and compiles the graph,
    which takes seconds (15 s for the demo on 2 shared cores) before Keras's
    progress bar shows anything. With a `verbose=1` progress bar this prints
    `0/steps ━━━━ tracing the training step ...` in the bar's own style,
    without a newline: the bar's first update overwrites it. Returns the
    text printed ("" when nothing was).
    """
    bars = [c for c in callbacks
            if isinstance(c, keras.callbacks.ProgbarLogger)
            and c.verbose == 1]
    function = getattr(model, "train_function", None)
    seen = _TRACED.get(model) if model is not None else None
    if not bars or function is None or (seen and seen() is function):
        return ""
    if not keras.config.is_interactive_logging_enabled():
        return ""
    target = bars[0].target
    if target:
        text = (f"\x1b[1m{0:>{len(str(target))}}/{target}\x1b[0m "
                f"\x1b[37m{'━' * 20}\x1b[0m {NOTICE}")
    else:
        text = f"{0:>7}/Unknown {NOTICE}"
    sys.stdout.write(text)
    sys.stdout.flush()
    return text


def _erase(text):
    """Blanks the notice's line for the progress bar's first update."""
    visible = re.sub(r"\x1b\[[0-9;]*m", "", text)
    sys.stdout.write("\r" + " " * len(visible) + "\r")
    sys.stdout.flush()


def _numpy(logs):
    if logs is None:
        return None
    out = {}
    for k, v in logs.items():
        if type(v) is not np.ndarray or v.ndim == 0:  # vectors pass as is
            if hasattr(v, "numpy"):
                v = v.numpy()
            if isinstance(v, np.generic) or (
                    isinstance(v, np.ndarray) and v.ndim == 0):
                v = float(v)
        out[k] = v
    return out
