"""Rebuilding a user's model under a strategy's scope."""

import keras

from keras_mirror import errors

_FIX = (
    "Pass a zero-argument function that builds the model instead, e.g. "
    "`MirroredModel(lambda: MyModel(...))`, or give the model "
    "`get_config()`/`from_config()`."
)


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


def build_original(model):
    """Returns the single-device model that `MirroredModel.model` exposes."""
    if isinstance(model, keras.Model):
        return model
    built = model()
    if not isinstance(built, keras.Model):
        raise TypeError(
            "`model` must return a `keras.Model` when called with no "
            f"arguments. Received: model() returned {built!r}"
        )
    return built


def check_weights_exist(model):
    """Refuses a model marked built whose layers never created weights.

    Keras's default `build()` on a subclassed model without a `build` of
    its own marks it built without building its layers (with a warning);
    the copy would then create its variables inside a replica step, where
    a strategy cannot mirror them.
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


def clone_in_scope(model, factory, strategy):
    """Creates the replica-mirrored copy of `model` inside `strategy.scope()`.

    `factory` is the user's model function, or None to clone `model`
    (Sequential and Functional models by `keras.models.clone_model`,
    subclassed ones by `from_config(get_config())`). The copy gets the
    original's weights when the original is built.
    """
    with strategy.scope():
        try:
            if factory is not None:
                clone = factory()
            else:
                clone = keras.models.clone_model(model)
        except Exception as e:  # noqa: BLE001 (any failure means: can't clone)
            raise errors.ModelRebuildError(
                f"keras-mirror could not rebuild the model "
                f"{type(model).__name__!r} under the distribution strategy "
                f"({type(e).__name__}: {e}). {_FIX} "
                f"Received: model={type(model).__name__}"
            ) from e
        if model.built and not clone.built:
            build_like(clone, model)
    if model.built:
        copy_weights(model, clone)
    return clone


def build_like(clone, model):
    """Builds `clone` with the input shapes that `model` was built with."""
    try:
        config = model.get_build_config()
        if config:
            clone.build_from_config(config)
    except Exception as e:  # noqa: BLE001
        raise errors.ModelRebuildError(
            f"keras-mirror could not build the copy of "
            f"{type(model).__name__!r} ({type(e).__name__}: {e}). {_FIX} "
            f"Received: model={type(model).__name__}"
        ) from e


def copy_weights(source, target):
    """Copies all weights of `source` into `target` (same architecture)."""
    src, dst = source.weights, target.weights
    if len(src) != len(dst) or any(
        tuple(a.shape) != tuple(b.shape) for a, b in zip(src, dst)
    ):
        raise errors.ModelRebuildError(
            f"The rebuilt copy of {type(source).__name__!r} has weights "
            f"{[tuple(w.shape) for w in dst]} but the model has "
            f"{[tuple(w.shape) for w in src]}. {_FIX} "
            f"Received: model={type(source).__name__}"
        )
    for a, b in zip(src, dst):
        b.assign(a.value)


def build_from_batch(model, x):
    """Builds an unbuilt model by calling it on a batch."""
    if not model.built:
        model(x, training=False)
