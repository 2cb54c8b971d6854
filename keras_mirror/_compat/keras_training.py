"""Keras's trainer, optimizers, losses and compiled metrics."""

import contextlib

import keras

from keras_mirror._compat._base import _missing  # noqa: F401
from keras_mirror._compat._base import _require
from keras_mirror._compat._base import note_replaced
from keras_mirror._compat._base import replaced
from keras_mirror._compat._base import replaced_method

# The TF backend's optimizer sums gradients across replicas inside `apply`
# (`TFOptimizer._all_reduce_sum_gradients`). keras-mirror all-reduces them
# itself first (so that clipping, weight decay and loss scaling see the global
# gradient, as on one device) and must switch this second reduction off, or
# gradients would count `N` times.
_ALLREDUCE_HOOK = "_all_reduce_sum_gradients"

# `fit` starts at `Trainer._initial_epoch` when set; Keras's `BackupAndRestore`
# sets it on the model it resumes. Callbacks get the user's model, so the
# wrapper's attribute is the user model's (`_user_model.UserModelState`).
INITIAL_EPOCH = "_initial_epoch"

# The loss tracker that `fit` reports as `loss`; Keras exposes it only through
# `model.metrics`, by name, so we look it up there.
_LOSS_TRACKER = "_loss_tracker"


# Keras builds the compiled loss and metrics lazily, on their first call. In a
# replica step that would create their variables inside `strategy.run`;
# `Trainer._symbolic_build` (what stock `fit` runs under a strategy) builds
# them from a batch's shapes without running a step.
_SYMBOLIC_BUILD = "_symbolic_build"


def _identity_allreduce(grads_and_vars):
    return list(grads_and_vars)


@contextlib.contextmanager
def disable_optimizer_allreduce(optimizer):
    """Within the block, `optimizer` (and a wrapped inner optimizer) does
    not all-reduce: the built-in step has, exactly once."""
    with contextlib.ExitStack() as stack:
        for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if opt is None:
                continue
            _require(opt, (_ALLREDUCE_HOOK,), type(opt).__name__,
                     "replace the optimizer's own gradient all-reduce")
            stack.enter_context(replaced(
                opt, {_ALLREDUCE_HOOK: _identity_allreduce},
                "the gradients are all-reduced once, explicitly, before the "
                "update", label="keras.optimizers.Optimizer"))
        yield


def loss_tracker(model):
    """The `Mean` metric behind `logs["loss"]`, or None before compile."""
    return getattr(model, _LOSS_TRACKER, None)


# The compiled metrics' container (`CompileMetrics`), one entry of
# `model.metrics`; the built-in step updates it outside the replicas.
_COMPILE_METRICS = "_compile_metrics"


def compile_metrics(model):
    """The `CompileMetrics` of `model.compile(metrics=...)`, or None."""
    return getattr(model, _COMPILE_METRICS, None)


# -- models with their own `train_step` (keras_mirror._custom_step) ---------

# Inside a `tf.distribute` strategy, Keras divides every reduced loss by the
# replica count (`keras.src.losses.loss.scale_loss_for_distribution`, used by
# `Loss.__call__` and `Model.compute_loss`; `unscale_loss_for_distribution`
# undoes it for the loss trackers). A user's own `train_step` run per replica
# must see the loss one device computes on its shard, so that keras-mirror
# can weight the gradients by the shard's share of the global batch instead;
# both functions are replaced by the identity while the replicas' steps are
# traced.
_LOSS_MODULE = "keras.src.losses.loss"
_LOSS_SCALERS = ("scale_loss_for_distribution", "unscale_loss_for_distribution")


def _loss_module():
    import importlib

    return importlib.import_module(_LOSS_MODULE)


def _identity(value):
    return value


@contextlib.contextmanager
def unscaled_losses():
    """Within the block, Keras losses are not divided by the replica count."""
    module = _loss_module()
    _require(module, _LOSS_SCALERS, _LOSS_MODULE,
             "compute a replica's own loss exactly")
    with replaced(module, {name: _identity for name in _LOSS_SCALERS},
                  reason="each replica computes its shard's own loss, "
                  "weighted by its share, not divided by the replica "
                  "count"):
        yield


@contextlib.contextmanager
def replace_optimizer_allreduce(optimizer, make_hook, reason):
    """Within the block, the gradient all-reduce of `optimizer` (and its
    inner one) is `make_hook(original)`.

    `make_hook(original)` receives the optimizer's own bound
    `_all_reduce_sum_gradients` and returns the function that takes its
    place (same contract: a list of `(gradient, variable)` pairs in, the
    all-reduced list out).
    """
    with contextlib.ExitStack() as stack:
        for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if opt is None:
                continue
            stack.enter_context(replaced_method(
                opt, _ALLREDUCE_HOOK, make_hook,
                "replace the optimizer's own gradient all-reduce", reason,
                owner="keras.optimizers.Optimizer"))
        yield


# The TF backend's optimizer applies each variable's update through
# `tf.distribute`, which under a `MirroredStrategy` enters a `merge_call` and
# runs the update once per device (a model with V variables on N replicas
# traces V * N updates): `TFOptimizer` through
# `tf.__internal__.distribute.interim.maybe_merge_call` (the update, the
# weight decay, the gradient accumulators) and its `_distribution_strategy`
# (EMA's weight overwrite calls `extended.update`), `LossScaleOptimizer` when
# `tf.__internal__.distribute.strategy_supports_no_merge_call()` is False.
# keras-mirror traces the update once, as a function of one replica's copies
# of the variables (`steps/_one_update.py`), where a `merge_call` would be
# refused. In that trace `maybe_merge_call` calls its function at once with a
# stand-in distribution whose `extended.update(var, fn, ...)` is
# `fn(var, ...)` (the optimizer's `_distribution_strategy` is the stand-in
# too) and `strategy_supports_no_merge_call()` is True: each variable's update
# runs once, on the copy the Keras variable is backed by in the trace.
_MERGE_CALL_OWNER = "tf.__internal__.distribute.interim"
_MERGE_CALL = "maybe_merge_call"
_NO_MERGE_CALL = "strategy_supports_no_merge_call"
_OPTIMIZER_STRATEGY = "_distribution_strategy"


class _InPlaceExtended:
    @staticmethod
    def update(var, fn, args=(), kwargs=None, group=True):
        del group
        return fn(var, *args, **(kwargs or {}))


class _InPlace:
    """The distribution the optimizer updates through in one trace."""

    extended = _InPlaceExtended()


def _in_place_merge_call(fn, strategy, *args, **kwargs):
    del strategy
    return fn(_InPlace, *args, **kwargs)


def _merge_call_modules():
    import tensorflow as tf

    purpose = "trace the optimizer's update once for all replicas"
    interim = tf.__internal__.distribute.interim
    _require(interim, (_MERGE_CALL,), _MERGE_CALL_OWNER, purpose)
    _require(tf.__internal__.distribute, (_NO_MERGE_CALL,),
             "tf.__internal__.distribute", purpose)
    return interim, tf.__internal__.distribute


@contextlib.contextmanager
def _distributing(optimizer, strategy, purpose, reason):
    """Within the block, `optimizer` (and a `LossScaleOptimizer`'s inner
    one) has `strategy` as its `_distribution_strategy`."""
    optimizers = [o for o in (optimizer, getattr(optimizer, "inner_optimizer",
                                                 None)) if o is not None]
    for o in optimizers:
        _require(o, (_OPTIMIZER_STRATEGY,), type(o).__name__, purpose)
    with contextlib.ExitStack() as stack:
        for o in optimizers:
            stack.enter_context(replaced(
                o, {_OPTIMIZER_STRATEGY: strategy},
                label="keras.optimizers.Optimizer", reason=reason))
        yield


def distributes_through(optimizer, strategy):
    """Within the block, `optimizer` updates through `strategy`, as an
    optimizer made in its scope does.

    Keras's TF optimizer keeps the strategy of its creation as
    `_distribution_strategy`; the user's optimizer was made on one device.
    While its variables are mirrored (`distribute/_homes.py`), code that
    updates them through it reaches every copy: `SwapEMAWeights`'s swaps
    (`extended.update` on each variable and its average) and EMA's
    overwrite at the end of `fit` (`finalize_variable_values`), which the
    default strategy cannot do on a `MirroredVariable` ("tuple indices must
    be integers or slices, not MirroredVariable").
    """
    return _distributing(optimizer, strategy,
                         "update mirrored variables through the strategy",
                         "while mirrored, EMA's swaps and overwrite reach "
                         "every copy")


@contextlib.contextmanager
def updates_in_place(optimizer):
    """Within the block, Keras's TF optimizer (and a `LossScaleOptimizer`'s
    inner one) updates each variable once, as given, without
    `tf.distribute` (see above)."""
    interim, distribute = _merge_call_modules()
    reason = ("each variable's update once, on the replica's own copy, "
              "without a `merge_call` per variable per replica")
    with _distributing(
            optimizer, _InPlace,
            "trace the optimizer's update once for all replicas", reason), \
            replaced(interim, {_MERGE_CALL: _in_place_merge_call},
                     label=_MERGE_CALL_OWNER, reason=reason), \
            replaced(distribute, {_NO_MERGE_CALL: lambda: True},
                     label="tf.__internal__.distribute", reason=reason):
        yield


def symbolic_build(model, data_batch):
    """Builds the model, compiled loss and compiled metrics from a batch."""
    getattr(model, _SYMBOLIC_BUILD)(data_batch=data_batch)


# Keras's compiled loss updates one `Mean` tracker per output with
# `sample_weight=<the batch's static row count>`, which a shard of dynamic
# size does not have (None: every shard then weighs 1, a mean of shard
# means). `CompileLoss.metrics` lists those trackers; `Trainer._compile_loss`
# is the compiled loss.
_COMPILE_LOSS = "_compile_loss"


def output_loss_trackers(model):
    """The per-output loss `Mean`s of `model`'s compiled loss (maybe [])."""
    compile_loss = getattr(model, _COMPILE_LOSS, None)
    if compile_loss is None:
        return []
    return list(getattr(compile_loss, "metrics", []) or [])


def has_compiled_loss_or_metrics(model):
    """Whether `model.compile` gave it a compiled loss or metrics."""
    return getattr(model, _COMPILE_LOSS, None) is not None or getattr(
        model, _COMPILE_METRICS, None) is not None


# A compiled loss (`CompileLoss`) computes each output's term in a loop over
# `_flat_losses`, namedtuples `(path, loss, loss_weights, name)` made on its
# first call, and logs each term with the `Mean` of the same index in
# `metrics`. keras-mirror lends it a list whose losses also report their
# value, to weight each output's term by its own reduction. A built-in loss
# (`keras.src.losses.losses.LossFunctionWrapper`, which also wraps a loss
# given by name) applies a Keras loss function to each sample, then reduces.
_FLAT_LOSSES = "_flat_losses"
_COMPILE_LOSS_CLASS = "keras.src.trainers.compile_utils.CompileLoss"
_LOSS_WRAPPER = ("keras.src.losses.losses", "LossFunctionWrapper")


def flat_losses(model):
    """The compiled loss's `(path, loss, loss_weights, name)` list, or None."""
    compile_loss = getattr(model, _COMPILE_LOSS, None)
    return None if compile_loss is None else getattr(
        compile_loss, _FLAT_LOSSES, None)


@contextlib.contextmanager
def reporting_flat_losses(model, report):
    """Within the block, output `i`'s loss value `v` also calls `report(i, v)`.
    """
    entries = flat_losses(model)
    if not entries:
        yield
        return
    compile_loss = getattr(model, _COMPILE_LOSS)

    def reporting(i, loss):
        def call(*args, **kwargs):
            value = loss(*args, **kwargs)
            report(i, value)
            return value
        return call

    with replaced(compile_loss, {_FLAT_LOSSES: [
            e._replace(loss=reporting(i, e.loss))
            for i, e in enumerate(entries)]}, label=_COMPILE_LOSS_CLASS,
            reason="each output's loss term weighted by its own kind"):
        yield


def keras_per_sample_loss(loss):
    """Whether `loss` is a built-in Keras loss of per-sample values."""
    import importlib

    module, name = _LOSS_WRAPPER
    wrapper = getattr(importlib.import_module(module), name)
    fn = getattr(loss, "fn", None)
    return (isinstance(loss, wrapper) and type(loss).call is wrapper.call
            and getattr(fn, "__module__", "").startswith("keras.")
            and getattr(keras.losses, getattr(fn, "__name__", ""),
                        None) is fn)


# `Layer._flatten_layers()` walks a model's layers (itself first) in the order
# `Layer.losses` collects their `add_loss` terms, which each layer keeps in
# `_losses`. Used only to name the layer of an `add_loss` term in an error.
_FLATTEN_LAYERS = "_flatten_layers"
_OWN_LOSSES = "_losses"


def layers_within(model):
    """Every layer `model` tracks, itself first (`Layer._flatten_layers`):
    attributes that hold a layer too (an RNN's `cell`), which
    `model.layers` does not list."""
    return list(getattr(model, _FLATTEN_LAYERS)(include_self=True))


def loss_owners(model):
    """`"layer 'name'"` for each `add_loss` term, in `model.losses` order."""
    owners = []
    for layer in getattr(model, _FLATTEN_LAYERS)(include_self=True):
        own = getattr(layer, _OWN_LOSSES, None) or []
        owners.extend([f"layer {layer.name!r}"] * len(own))
    return owners


# A TF-backend optimizer finds a variable's slots through
# `_trainable_variables_indices`, keyed by `_var_key(variable)`: the unique id
# of the TF variable behind it. When `_homes` switches a variable's backing,
# the keys must follow, from the optimizer's own `_trainable_variables`: the
# map its own `build` makes, for the new backings. Not restored as it was:
# the backings it was keyed by are released (`_homes`), like `_value`.
_OPT_INDICES = "_trainable_variables_indices"
_OPT_VARIABLES = "_trainable_variables"


def optimizer_trainables(optimizer):
    """The variables `optimizer` was built on (`_trainable_variables`), the
    ones its `apply` updates when given none (EMA's too); [] unbuilt."""
    _require(optimizer, (_OPT_VARIABLES,), type(optimizer).__name__,
             "apply an own step's gradients on each replica's copies")
    return list(getattr(optimizer, _OPT_VARIABLES))


def rekey_optimizer(optimizer):
    """Re-indexes `optimizer` (and an inner one) by the current backings."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or not getattr(opt, "built", False):
            continue
        _require(opt, (_OPT_INDICES, _OPT_VARIABLES, "_var_key"),
                 type(opt).__name__,
                 "train the model's own optimizer on a strategy")
        setattr(opt, _OPT_INDICES, {
            opt._var_key(v): i
            for i, v in enumerate(getattr(opt, _OPT_VARIABLES))})
        note_replaced("keras.optimizers.Optimizer", _OPT_INDICES,
                      "an optimizer finds a variable's slots by its "
                      "backing, which re-homing switches")
