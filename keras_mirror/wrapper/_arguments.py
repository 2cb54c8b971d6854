"""Eager checks of the scalar arguments of `fit`, `evaluate`, `predict`
and `compile` that plain Keras takes silently or fails on late.

Plain Keras trains nothing for `epochs=-1`, accepts `validation_split=-0.2`
and `evaluate(batch_size=0)`, and divides by `validation_freq=0` only after
a whole epoch. Here each is refused before any step runs, in Keras's form:
the argument in backticks, what was expected, `Received: name=value`.
"""

import keras
import numpy as np

from keras_mirror import allreduce
from keras_mirror.steps import _execution
from keras_mirror.steps._batchnorm import BATCHNORM_MODES

BATCH_MODES = ("global", "per_replica")
NONFINITE_MODES = ("warn", "skip_step", "raise")


def is_int(value):
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and \
        not isinstance(value, bool)


def is_number(value):
    """A Python or NumPy integer or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, bool)


def positive_int(name, value):
    """`value` must be None or an integer of at least 1."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(
            f"`{name}` must be a positive integer or None. "
            f"Received: {name}={value!r}")


def check_epochs(epochs, initial_epoch):
    if not is_int(epochs) or epochs < 0:
        raise ValueError(
            "`epochs` must be a non-negative integer (the index of the "
            f"last epoch to train). Received: epochs={epochs!r}")
    if not is_int(initial_epoch) or not 0 <= initial_epoch <= epochs:
        raise ValueError(
            f"`initial_epoch` must be an integer in [0, epochs={epochs}]: "
            "training runs epochs initial_epoch+1 ... epochs. "
            f"Received: initial_epoch={initial_epoch!r}")


def check_validation(kwargs):
    split = kwargs.get("validation_split", 0.0)
    if not is_number(split) or not 0.0 <= split < 1.0:
        raise ValueError(
            "`validation_split` must be a number in [0, 1): the fraction "
            "of the arrays held out for validation. "
            f"Received: validation_split={split!r}")
    freq = kwargs.get("validation_freq", 1)
    if not is_int(freq) or freq < 1:
        raise ValueError(
            "`validation_freq` must be a positive integer (validate every "
            f"this many epochs). Received: validation_freq={freq!r}")


def check_class_weight_values(class_weight):
    """The weights of a `class_weight` dict must be numbers."""
    for key, weight in (class_weight or {}).items():
        if not is_number(weight):
            raise ValueError(
                "`class_weight` must map each class index to a number. "
                f"Received: class_weight[{key!r}]={weight!r}")


def check_callbacks(callbacks):
    """A list (or tuple, or `CallbackList`) of callback instances; the
    message names the first bad item by its index."""
    if callbacks is None or isinstance(callbacks,
                                       keras.callbacks.CallbackList):
        return
    expected = ("`callbacks` must be a list of `keras.callbacks.Callback` "
                "objects (e.g. `[keras.callbacks.TensorBoard('logs')]`).")
    if not isinstance(callbacks, (list, tuple)):
        raise ValueError(f"{expected}{_class_hint(callbacks)} "
                         f"Received: callbacks={callbacks!r}")
    for i, c in enumerate(callbacks):
        if not isinstance(c, keras.callbacks.Callback):
            raise ValueError(f"{expected}{_class_hint(c)} "
                             f"Received: callbacks[{i}]={c!r}")


def _class_hint(value):
    if isinstance(value, type) and issubclass(value,
                                              keras.callbacks.Callback):
        return (f" `{value.__name__}` is a class: pass an instance, "
                f"`{value.__name__}(...)`.")
    return ""


def check_fit_arguments(epochs, callbacks, kwargs):
    """`fit`'s scalar arguments, before any step."""
    check_epochs(epochs, kwargs.get("initial_epoch", 0))
    check_validation(kwargs)
    if isinstance(kwargs.get("class_weight"), dict):
        check_class_weight_values(kwargs["class_weight"])
    check_callbacks(callbacks)


def check_steps_per_execution(kwargs):
    """`compile(steps_per_execution=...)`: a positive integer, as Keras's
    own `Trainer` would need (it accepts 0 and then never runs a step)."""
    value = kwargs.get("steps_per_execution", 1)
    if not is_int(value) or value < 1:
        raise ValueError(
            "`steps_per_execution` must be a positive integer. "
            f"Received: steps_per_execution={value!r}")


def check_choice(name, value, choices):
    """Raises ValueError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(
            f"`{name}` must be one of {tuple(choices)}. "
            f"Received: {name}={value!r}"
        )


def check_construction(batch, on_nonfinite, replica_stats, communication,
                       bytes_per_pack, timeout_seconds, gradient_dtype,
                       execution, batchnorm="global"):
    """`MirroredModel`'s scalar arguments; returns the collective options.
    """
    check_choice("batch", batch, BATCH_MODES)
    check_choice("on_nonfinite", on_nonfinite, NONFINITE_MODES)
    if not isinstance(replica_stats, bool):
        raise ValueError(
            "`replica_stats` must be True or False. "
            f"Received: replica_stats={replica_stats!r}")
    check_choice("communication", communication, ("auto", "ring", "nccl"))
    comm = allreduce.communication_options(
        communication, bytes_per_pack, timeout_seconds)
    allreduce.check_gradient_dtype(gradient_dtype)
    _execution.check(execution)
    check_choice("execution", execution, _execution.EXECUTIONS)
    check_choice("batchnorm", batchnorm, BATCHNORM_MODES)
    return comm
