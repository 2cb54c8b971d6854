"""The `model` argument: checks, the factory form, its inputs' shapes.

`MirroredModel` trains the user's own model object in place (see
`_homes.py`); nothing here copies a model.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors


def check_model(model):
    """Validates the `model` argument: a Keras model or a model factory."""
    if isinstance(model, keras.Model):
        return
    if callable(model) and not isinstance(model, keras.layers.Layer):
        return
    raise TypeError(
        "`model` must be a `keras.Model` or a zero-argument function that "
        f"returns one. Received: model={model!r}"
    )


def check_not_wrapped(model):
    """Refuses a `MirroredModel` passed to `MirroredModel`.

    Recognised by its class marker `_keras_mirror_wrapper`, not by
    `isinstance`: this module sits below `mirrored_model` and cannot import it.
    """
    if getattr(type(model), "_keras_mirror_wrapper", False):
        raise ValueError(
            "`model` is already a `MirroredModel`: wrap the plain Keras "
            "model once (`MirroredModel(model)`), or use the existing "
            f"wrapper. Received: model={model.name!r}")


def build_original(model):
    """Returns the user's model (calling a factory once)."""
    if isinstance(model, keras.Model):
        return model
    built = model()
    if not isinstance(built, keras.Model):
        raise TypeError(
            "`model` must return a `keras.Model` when called with no "
            f"arguments. Received: model() returned {built!r}"
        )
    return built


def check_original(model, local_replicas, cluster=None):
    """The checks on the user's model object, once it is in hand."""
    check_weights_exist(model)
    check_not_stateful(model, local_replicas, cluster)
    check_no_foreign_variables(model)


def check_weights_exist(model):
    """Refuses a model marked built whose layers never created weights.

    Keras's default `build()` on a subclassed model without a `build` of
    its own marks it built without building its layers (with a warning);
    its variables would then be created inside a replica step, where a
    strategy cannot mirror them.
    """
    unbuilt = [layer.name for layer in model.layers if not layer.built]
    if model.built and not model.weights and unbuilt:
        raise errors.ModelRebuildError(
            f"`model` is marked built but has no weights: its layers "
            f"{unbuilt} were never built (Keras's `build()` does this to a "
            "subclassed model without a `build` method of its own). Call "
            "the model once on a batch, give it a `build` method, or pass "
            "it unbuilt: keras-mirror then builds it from the first batch. "
            f"Received: model={type(model).__name__}"
        )


def stateful_layers(model):
    """Names of the model's stateful RNN layers (`stateful=True`)."""
    return [layer.name for layer in _compat.layers_within(model)
            if getattr(layer, "stateful", False) is True]


def check_not_stateful(model, local_replicas, cluster=None):
    """Refuses stateful RNNs over several replicas, naming the layers.

    A stateful RNN keeps one state row per row of a fixed batch and carries
    it to the same row of the next batch. Split over replicas, each shard
    would have to read and write only its own rows of that state, always
    the same rows; keras-mirror does not do that, so it refuses rather
    than train differently from one device.
    """
    names = stateful_layers(model)
    if not names or (local_replicas == 1 and cluster is None):
        return
    replicas = (f"{local_replicas} replicas" if cluster is None else
                f"{local_replicas} replicas per worker of a cluster")
    raise ValueError(
        f"keras-mirror cannot split a stateful RNN over {replicas}: "
        f"the layers {names} keep one state row per row of "
        "the batch across batches, which the replicas' shards would "
        "have to share. Train it on one device, or use `stateful=False` "
        "(each batch starts from a zero state). Received: model with "
        f"stateful layers {names} and {replicas}")


def expected_inputs(model):
    """The model's input structure of `KerasTensor`s, or None (unbuilt)."""
    try:
        if isinstance(model, keras.Sequential):
            inputs = model.inputs
            return inputs[0] if inputs and len(inputs) == 1 else None
        return model.input
    except (AttributeError, ValueError):
        return None


def fits(shape, expected):
    """Whether inputs of `shape` fit a model input of shape `expected`
    (None: any size), after the rank adjustment a Functional model makes
    (`Functional._adjust_input_rank`): a trailing axis of size 1 is
    dropped, or added where the input declares one."""
    shape, expected = tuple(shape), tuple(expected)
    if len(shape) == len(expected) + 1 and shape[-1] == 1:
        shape = shape[:-1]
    elif len(shape) == len(expected) - 1 and expected[-1] == 1:
        expected = expected[:-1]
    return len(shape) == len(expected) and all(
        e is None or s is None or int(s) == int(e)
        for s, e in zip(shape[1:], expected[1:]))


def is_strings(dtype):
    """Whether `dtype` (NumPy's, TensorFlow's or a Keras name) holds
    strings."""
    if dtype is None:
        return False
    if isinstance(dtype, tf.dtypes.DType) or dtype == "string":
        return dtype in (tf.string, "string")
    try:
        return np.dtype(dtype).kind in "US"
    except TypeError:
        return False


def check_no_outer_scope(model):
    """`MirroredModel(model)` must not be created inside a `tf.distribute`
    scope: the wrapper makes its own strategy. (A double wrap is refused by
    `_rebuild.check_not_wrapped`.)"""
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        raise errors.StrategyScopeError(
            "`MirroredModel` must be created outside any "
            "`tf.distribute.Strategy.scope()`: it makes its own strategy "
            "over `devices`, and TensorFlow cannot mix two. Create it after "
            "the `with strategy.scope():` block. Received: a MirroredModel "
            f"created inside {type(strategy).__name__}.scope()")


def check_no_foreign_variables(model):
    """Refuses a model whose variables belong to another strategy.

    A model built inside `tf.distribute.MirroredStrategy().scope()` holds
    distributed variables that only that strategy can update; TensorFlow
    would fail deep in the first step (`Need to be inside "with
    strategy.scope()"`).
    """
    for variable in getattr(model, "variables", []):
        tf_variable = _compat.backing(variable)
        if isinstance(tf_variable, tf.distribute.DistributedValues):
            raise errors.StrategyScopeError(
                "`model` must be built outside any `tf.distribute` "
                "strategy: its variable "
                f"{variable.path!r} belongs to a strategy "
                f"({type(tf_variable).__name__}), and keras-mirror makes "
                "its own. Build the model (or load it) outside the "
                "`with strategy.scope():` block. Received: model="
                f"{model.name!r} with {type(tf_variable).__name__}s")


def outside_other_strategies(method):
    """Decorates a `MirroredModel` method: refuses to run it inside the
    scope of a strategy other than the wrapper's own, before anything
    (an optimizer's slots, a traced step) is created under it."""
    @functools.wraps(method)
    def checked(mirrored, *args, **kwargs):
        if tf.distribute.has_strategy() and \
                tf.distribute.get_strategy() is not mirrored._strategy:
            strategy = tf.distribute.get_strategy()
            raise errors.StrategyScopeError(
                f"`MirroredModel.{method.__name__}` must be called outside "
                "any other `tf.distribute.Strategy.scope()`: the wrapper "
                "runs on its own strategy over `devices`, and TensorFlow "
                "cannot mix two. Call it after the `with strategy.scope():` "
                f"block. Received: {method.__name__} called inside "
                f"{type(strategy).__name__}.scope()")
        return method(mirrored, *args, **kwargs)

    return checked
