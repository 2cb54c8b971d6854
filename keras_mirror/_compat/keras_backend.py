"""Keras's variables, masks, random draws and TF backend functions."""

import contextlib  # noqa: F401

import keras  # noqa: F401

from keras_mirror._compat._base import _missing  # noqa: F401
from keras_mirror._compat._base import _require
from keras_mirror._compat._base import note_replaced

# -- masks (keras_mirror.steps.arithmetic, steps.in_graph) ----------------

# A masking layer (`Embedding(mask_zero=True)`, `Masking`) marks its output
# with a mask that Keras keeps on the tensor itself; the compiled loss divides
# a masked output's loss by the number of unmasked entries, and the compiled
# metrics skip masked entries. keras-mirror reads each shard's mask to weight
# the shard by its share of the unmasked entries (not of the rows), and sets
# the concatenated mask on the concatenated predictions, so that loss and
# metrics equal one device's. Keras exposes no public accessor for it.
_MASK_MODULE = "keras.src.backend.common.masking"


def _masking():
    import importlib

    module = importlib.import_module(_MASK_MODULE)
    _require(module, ("get_keras_mask", "set_keras_mask"), _MASK_MODULE,
             "weight masked losses exactly")
    return module


def get_mask(tensor):
    """The Keras mask of `tensor`, or None."""
    return _masking().get_keras_mask(tensor)


def set_mask(tensor, mask):
    """Marks `tensor` with the Keras mask `mask` (in place)."""
    _masking().set_keras_mask(tensor, mask)


# -- building a model without running it (keras_mirror.wrapper._rebuild) ----

# Keras's `fit` builds an unbuilt model with
# `backend.compute_output_spec(model, x, training=False)` on symbolic
# tensors (`Trainer._symbolic_build`): the model's `call` is traced in a
# scratch graph, in a stateless scope, so its side effects (a counter's
# `assign`, an `add_loss`) never happen outside the steps. keras-mirror
# builds the same way; `compute_output_spec` is not exported.
_BACKEND_MODULE = "keras.src.backend"


def compute_output_spec(fn, *args, **kwargs):
    """Keras's `backend.compute_output_spec(fn, *args, **kwargs)`."""
    import importlib

    module = importlib.import_module(_BACKEND_MODULE)
    _require(module, ("compute_output_spec",), _BACKEND_MODULE,
             "build a model from a batch without running it")
    return module.compute_output_spec(fn, *args, **kwargs)


# -- the user's variables, re-homed in place (keras_mirror._homes) ------------

# A Keras variable (`keras.Variable`, TF backend) keeps its TensorFlow variable
# in `_value` and creates it in `_initialize(value)`, with the aggregation and
# synchronization Keras chose. keras-mirror trains the user's own model object
# on a `MirroredStrategy` by giving each of its variables a second backing
# variable made by `_initialize` inside the strategy's scope (a
# `MirroredVariable`, the value kept), and switches between the two: mirrored
# while the wrapper trains, single-device otherwise, so that the user's
# `model.fit`/`predict` keep working on one device. Keras has no public way to
# re-home a variable.
_VARIABLE_BACKING = "_value"
_VARIABLE_INITIALIZE = "_initialize"


_BACKING_PURPOSE = ("train the model's own variables on a tf.distribute "
                    "strategy")


def _check_variable_api(variable):
    _require(variable, (_VARIABLE_BACKING, _VARIABLE_INITIALIZE), "Variable",
             _BACKING_PURPOSE)


def backing(variable):
    """The TensorFlow variable behind a Keras variable."""
    try:
        return getattr(variable, _VARIABLE_BACKING)
    except AttributeError:
        raise _missing(f"Variable.{_VARIABLE_BACKING}",
                       _BACKING_PURPOSE) from None


def set_backing(variable, tf_variable):
    """Makes `tf_variable` the one behind the Keras `variable`."""
    _check_variable_api(variable)
    setattr(variable, _VARIABLE_BACKING, tf_variable)
    note_replaced("keras.Variable", _VARIABLE_BACKING,
                  "the variable's backing TF variable: the model trains on "
                  "mirrored variables without a rebuild")


def new_backing(variable, value):
    """A new TF variable for `variable` (in the current scope), not installed.

    It has the Keras variable's dtype, aggregation and synchronization, and
    the current backing's own `trainable` flag: the one TensorFlow's tape
    reads, fixed when the backing was made (a layer frozen then unfrozen
    keeps it), so that gradients flow exactly where they flow on one
    device. Created inside a strategy's scope it is distributed.
    """
    current = backing(variable)
    keras_trainable = variable.trainable
    try:
        variable.trainable = getattr(current, "trainable", keras_trainable)
        getattr(variable, _VARIABLE_INITIALIZE)(value)
        return backing(variable)
    finally:
        variable.trainable = keras_trainable
        set_backing(variable, current)


# -- keras.random draws inside a replica (keras_mirror._random) ---------------

# Keras's random functions (`keras.random.*`, Dropout, GaussianNoise, ...)
# call the TF backend's module `keras.src.backend.tensorflow.random` at call
# time, through the `backend.random` attribute. keras-mirror replaces its
# shape-taking functions while a replica step is traced, so that a draw whose
# leading dimension is the replica's shard draws the global batch's rows (same
# seed, same generator advance) and keeps this shard's: exactly one device's
# numbers. The names replaced are checked here.
_RANDOM_MODULE = "keras.src.backend.tensorflow.random"
RANDOM_FUNCTIONS = ("normal", "uniform", "truncated_normal", "randint",
                    "dropout", "gamma", "binomial", "beta", "categorical",
                    "shuffle")


def random_module():
    """The TF backend's random module, checked for the functions replaced."""
    import importlib

    module = importlib.import_module(_RANDOM_MODULE)
    _require(module, RANDOM_FUNCTIONS + ("_cast_seed", "draw_seed"),
             _RANDOM_MODULE,
             "make random draws inside a replica equal one device's")
    return module


# Synchronized BatchNormalization computes its moments through the TF
# backend's `nn.moments(..., synchronized=True)`, which calls the module's
# `_compute_moments_sync` at call time: local sums and counts, all-reduced.
# keras-mirror replaces it inside replica steps so that a stand-in replica
# (an empty shard running one row, `steps/_stand_in.py`) adds nothing.
_NN_MODULE = "keras.src.backend.tensorflow.nn"
SYNC_MOMENTS = "_compute_moments_sync"
LOCAL_MOMENTS = "_compute_moments"  # plain BatchNorm's, made global


def moments_module():
    """The TF backend's nn module, checked for the synchronized moments."""
    import importlib

    module = importlib.import_module(_NN_MODULE)
    _require(module, (SYNC_MOMENTS, LOCAL_MOMENTS, "moments"), _NN_MODULE,
             "leave empty shards out of synchronized BatchNorm statistics")
    return module


# Keras keeps the generator that unseeded `keras.random` calls draw from in
# its global state, created on first use; `verify` restores its state.
_GLOBAL_STATE_MODULE = "keras.src.backend.common.global_state"
_GLOBAL_SEED_GENERATOR = "global_seed_generator"


def global_seed_generator():
    """Keras's global `SeedGenerator`, or None when none was made yet."""
    import importlib

    module = importlib.import_module(_GLOBAL_STATE_MODULE)
    _require(module, ("get_global_attribute",), _GLOBAL_STATE_MODULE,
             "restore the global seed generator after `verify`")
    return module.get_global_attribute(_GLOBAL_SEED_GENERATOR)


# Keras makes its global generator on the first unseeded draw
# (`keras.src.random.seed_generator.global_seed_generator`). keras-mirror
# makes it before a wrapper call instead, so that its state variable can be
# mirrored with the model's: an unseeded draw in a replica step then reads
# and advances one state shared by every replica, as one device does.
_SEED_GENERATOR_MODULE = "keras.src.random.seed_generator"
_MAKE_GLOBAL_SEED_GENERATOR = "global_seed_generator"


def made_global_seed_generator():
    """Keras's global `SeedGenerator`, made now (as Keras would) if none.

    Python's `random` state is kept: the generator's seed is the one
    Keras's next unseeded draw would have made it with, and the user's
    stream of Python random numbers is unchanged.
    """
    import importlib
    import random

    module = importlib.import_module(_SEED_GENERATOR_MODULE)
    _require(module, (_MAKE_GLOBAL_SEED_GENERATOR,), _SEED_GENERATOR_MODULE,
             "share Keras's global seed generator between the replicas")
    if global_seed_generator() is not None:
        return global_seed_generator()
    state = random.getstate()
    try:
        return getattr(module, _MAKE_GLOBAL_SEED_GENERATOR)()
    finally:
        random.setstate(state)
