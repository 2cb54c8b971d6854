"""Compiling through the wrapper: the user's `compile`, the user's objects.

`MirroredModel.compile(...)` calls the wrapped model's own `compile` with the
arguments unchanged (Keras's, or a GAN's `compile(d_optimizer=...,
g_optimizer=..., loss_fn=...)`). The loss functions, metrics and optimizers
are the user's objects, never rebuilt from a config. Then `adopt` prepares
them for the replicas and compiles the wrapper itself as a shell that Keras's
`fit` can run: it shares the model's optimizer (or, for a model with its own
`train_step`, gets a step counter) and reports the model's metrics.
"""

import warnings

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.distribute import _homes
from keras_mirror.steps import own_step
from keras_mirror.wrapper import _arguments
from keras_mirror.wrapper import _inputs
from keras_mirror.wrapper import _own_step_applies
from keras_mirror.wrapper import _rebuild

# Every reduction Keras's `Loss` defines; each is weighted exactly.
KERAS_REDUCTIONS = ("sum_over_batch_size", "mean", "sum",
                    "mean_with_sample_weight", "none", None)


def compile(mirrored, *args, **kwargs):
    """`MirroredModel.compile`: the model's own `compile`, then `adopt`."""
    _arguments.check_steps_per_execution(kwargs)
    if not mirrored._custom_step:
        check_reductions(kwargs.get("loss", args[1] if len(args) > 1
                                    else None), mirrored._inner)
    mirrored._inner.compile(*args, **kwargs)
    adopt(mirrored)


def adopt(mirrored):
    """Prepares a compiled model's optimizers and compiles the wrapper."""
    inner = mirrored._inner
    custom = mirrored._custom_step
    if not custom:
        check_reductions(getattr(inner, "loss", None), inner)
    for optimizer in _homes.optimizers_of(inner):
        if custom:
            own_step.prepare_optimizer(optimizer)
        else:
            # The steps all-reduce the gradients themselves, exactly once.
            _compat.disable_optimizer_allreduce(optimizer)
    if custom:
        # Counts global steps (`iterations`) for callbacks and backups;
        # the model's own optimizers count their own updates.
        optimizer = keras.optimizers.SGD(name="mirrored_step")
        optimizer.build([])
    else:
        optimizer = inner.optimizer
    keras.Model.compile(
        mirrored, optimizer=optimizer,
        steps_per_execution=getattr(inner, "steps_per_execution", 1) or 1,
        run_eagerly=bool(getattr(inner, "run_eagerly", False)),
        # The step's all-reduce and optimizer update stay uncompiled; each
        # replica's work follows the model's `jit_compile` (`steps/_xla`).
        jit_compile=False, auto_scale_loss=False)
    mirrored._reductions = None
    mirrored._adopted = _CompileState(inner)


class _CompileState:
    """What a compile of the user's model set, as the wrapper adopted it.

    Keras's `compile` makes a new loss tracker every time, so a tracker that
    is not the adopted one means the model was compiled again.
    """

    def __init__(self, model):
        self.tracker = _compat.loss_tracker(model)
        self.optimizer = getattr(model, "optimizer", None)
        self.trainable = _trainable_state(model)

    def warn_if_trainable_changed(self, model):
        """Keras's intended warning (dead code in Keras 3.15's trainer)."""
        current = _trainable_state(model)
        changed = [name for name, flag in current.items()
                   if self.trainable.get(name) != flag]
        self.trainable = current
        if changed:
            warnings.warn(
                "A layer's `trainable` state has changed since the model "
                "was compiled; as in Keras, the change takes effect when "
                "the model is compiled again (`model.compile(...)`), and "
                "until then training goes on as compiled. "
                f"Changed layers: {changed}", UserWarning, stacklevel=3)

    def recompiled(self, model):
        return _compat.loss_tracker(model) is not self.tracker

    def optimizer_replaced(self, model):
        return getattr(model, "optimizer", None) is not self.optimizer


def _trainable_state(model):
    return {layer.name: layer.trainable
            for layer in [model] + _rebuild.all_layers(model)}


def follow(mirrored):
    """Adopts what the user did to the model since the last wrapper call.

    Called first in every wrapper call. A `model.compile(...)` after
    wrapping (the fine-tuning guide's recompile after `trainable = True`, a
    new loss, optimizer or `steps_per_execution`) takes effect in this call,
    as it would in the model's own next `fit`. A `model.optimizer` replaced
    without compiling is refused: plain Keras would keep training with the
    optimizer its traced step captured, silently.
    """
    inner = mirrored._inner
    if not getattr(inner, "compiled", False):
        return
    state = mirrored.__dict__.get("_adopted")
    if state is None or state.recompiled(inner):
        adopt(mirrored)
        mirrored._homes.refresh()
        return
    state.warn_if_trainable_changed(inner)
    if state.optimizer_replaced(inner):
        raise ValueError(
            "The wrapped model's `optimizer` was replaced after it was "
            "compiled. Keras's own `fit` would keep training with the "
            "optimizer its step was traced with; compile the model again "
            "(`model.compile(optimizer=...)`) so that the new one trains. "
            f"Received: model.optimizer={inner.optimizer!r}, compiled "
            f"with optimizer={state.optimizer!r}")


def build(mirrored, batch):
    """Builds the compiled loss, metrics and every optimizer from a batch.

    On one device, as the user's model would be; nothing may be created
    inside a replica step.
    """
    inner = mirrored._inner
    if not getattr(inner, "compiled", False):
        return
    if not mirrored._custom_step:
        _compat.symbolic_build(inner, batch)
    elif _compat.has_compiled_loss_or_metrics(inner):
        _build_own_step_loss(inner, batch)
    optimizers = [o for o in _homes.optimizers_of(inner) if not o.built]
    if mirrored._custom_step and optimizers:
        applied = _own_step_applies.applied_variables(inner, optimizers,
                                                      batch)
    else:
        applied = {}
    for optimizer in optimizers:
        # Keras builds an optimizer on the variables of its first `apply`:
        # an own step's optimizer on what that step applies it to (a GAN's
        # `d_optimizer` on the discriminator's), read from a dry trace.
        variables = applied.get(id(optimizer), inner.trainable_variables)
        if variables:
            optimizer.build(variables)


def _build_own_step_loss(model, batch):
    """Builds the compiled loss and metrics of a model with its own step.

    Its own `train_step` decides what the compiled objects see (keras.io's
    DDIM has no `call` and uses `self.loss` as a plain function); when the
    model cannot be run symbolically, they are left to that step, as on
    one device.
    """
    try:
        _compat.symbolic_build(model, batch)
    except (NotImplementedError, RuntimeError):
        pass


def ensure_built(mirrored, x, y=None, sample_weight=None, first=None):
    """Builds the model, optimizers, loss and metrics before a step.

    Building in the first step would split an unbuilt model's first
    batch (which may not divide) and create variables inside replicas.
    Everything is built on one device, as the user's model would be;
    the variables then move to the strategy (`_homes`). The batch comes
    from the input's spec where it can, else from `first` (`_inputs.First`).
    """
    inner = mirrored._inner
    batch = _inputs.first_batch(x, y, sample_weight,
                                shapes_only=inner.built, first=first)
    if batch is None:
        if inner.built and all(
                o.built for o in _homes.optimizers_of(inner)):
            return
        raise ValueError(
            "The wrapped model is not built and keras-mirror cannot "
            "take a batch from this input to build it. Build the model "
            "first (e.g. `model.build(input_shape)`). "
            f"Received: x={type(x).__name__}")
    _rebuild.build_from_batch(inner, batch[0])
    build(mirrored, batch)
    mirrored.built = True
    mirrored._homes.refresh()


def require_compiled(mirrored, method):
    """Raises unless the wrapper is compiled, naming `method`."""
    if not mirrored.compiled or mirrored.optimizer is None:
        raise ValueError(
            f"`MirroredModel.{method}` needs a compiled model: call "
            "`mirrored.compile(optimizer=..., loss=...)` first, or wrap "
            f"a compiled model. Received: compiled={mirrored.compiled}")


def check_reductions(loss, model=None):
    """Refuses a `Loss` whose reduction keras-mirror cannot weight exactly.

    Keras's reductions are weighted by their kind (`steps/_reductions`). A
    reduction Keras does not define (a `Loss` subclass with its own
    `__call__` and, say, `reduction="median"`) has no known weighting; a
    `"mean_with_sample_weight"` loss under a `compute_loss` override
    neither, since the override decides how the outputs combine, and
    keras-mirror sees the combination only as a whole.
    """
    for leaf in tf.nest.flatten(loss):
        if not isinstance(leaf, keras.losses.Loss):
            continue
        reduction = getattr(leaf, "reduction", "sum_over_batch_size")
        if reduction not in KERAS_REDUCTIONS:
            raise ValueError(
                "`loss` must have a reduction Keras defines, one of "
                f"{KERAS_REDUCTIONS}: keras-mirror weights each replica's "
                "loss by its reduction, and another reduction's share of "
                f"the global batch is unknown. Received: loss={leaf!r} "
                f"with reduction={reduction!r}")
        if reduction == "mean_with_sample_weight" and model is not None \
                and type(model).compute_loss is not keras.Model.compute_loss:
            raise ValueError(
                "`loss` with reduction='mean_with_sample_weight' cannot be "
                "weighted under a `compute_loss` override: each replica's "
                "share is its part of the global sum of sample weights, "
                "and keras-mirror sees the override's combination of the "
                "outputs only as a whole. Use "
                "reduction='sum_over_batch_size' or 'sum', or Keras's own "
                f"`compute_loss`. Received: loss={leaf!r} with "
                f"reduction={reduction!r} and compute_loss="
                f"{type(model).__name__}.compute_loss")
