"""A model class's own `fit`, `evaluate` and `predict` run under the wrapper.

Some model classes override Keras's training API to prepare their input
before they hand it to Keras: keras-hub's tasks (`ImageClassifier`,
`CausalLM`, ...) turn arrays into a batched dataset, apply their
preprocessor and fold `validation_split` and `class_weight` in, then call
`super().fit(...)`. That override decides the rows each step sees and
their order. keras-hub's array input, for one, is batched in order
(Keras ignores `shuffle` for a dataset), so plain `fit(x, y)` on such a
model does not shuffle.

`MirroredModel.fit` (and the others) run on the wrapper, whose class is not
the user's: Keras's own `fit` would see the raw arrays and shuffle them
(0.23 from one device after 2 epochs for a keras-hub `ImageClassifier`,
measured), and skip the preprocessor. So when the user's class overrides a
method, `through_model` calls the user's own method on the user's model,
and routes the call it makes to Keras's method (`super().fit(...)`, which
Python resolves to `keras.Model.fit`) to the wrapper's: every step runs
the user's prepared input, on the replicas, as plain Keras would run it on
one device.

The routing replaces `keras.Model.<name>` for the duration of the call only
and answers only for the user's model object; any other model's call (the
wrapper's own `super().fit`, for one) goes to Keras's method unchanged.
"""

import functools

import keras

from keras_mirror import _compat


def overrides(model, name):
    """Whether `model`'s class has its own `name` instead of Keras's."""
    return getattr(type(model), name) is not getattr(keras.Model, name)


def through_model(method):
    """Decorates a `MirroredModel` method named as one of Keras's (`fit`,
    `evaluate`, `predict` and their `*_on_batch` forms):
    runs the user's model's own override of it, if its class has one,
    with its call to Keras's method routed to the wrapper's (`method`)."""
    name = method.__name__

    @functools.wraps(method)
    def run(mirrored, *args, **kwargs):
        model = mirrored.model
        if not overrides(model, name):
            return method(mirrored, *args, **kwargs)
        target = functools.partial(method, mirrored)
        with _routed(name, model, target):
            return getattr(model, name)(*args, **kwargs)

    return run


def _routed(name, model, target):
    """`keras.Model.<name>` calls `target` for `model`, during the block."""
    original = getattr(keras.Model, name)

    @functools.wraps(original)
    def routed(self, *args, **kwargs):
        if self is model:
            return target(*args, **kwargs)
        return original(self, *args, **kwargs)

    return _compat.replaced(
        keras.Model, {name: routed}, label="keras.Model",
        reason="a model class's own method runs, and its `super()` call "
        "reaches the wrapper")
