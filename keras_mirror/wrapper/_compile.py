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
import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.distribute import _homes
from keras_mirror.steps import _batchnorm
from keras_mirror.wrapper import _arguments
from keras_mirror.wrapper import _own_step_applies

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
    """Checks a compiled model's losses and compiles the wrapper.

    The model's optimizers are left as they are: their hooks are replaced
    only around a replica step's trace (`steps/_scope.replica_scope`,
    `own_step.optimizer_hooks`).
    """
    inner = mirrored._inner
    custom = mirrored._custom_step
    if not custom:
        check_reductions(getattr(inner, "loss", None), inner)
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
    mirrored._step_state.reductions = None
    mirrored._step_state.batchnorm = None
    mirrored._step_state.adopted = _CompileState(inner)


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
            for layer in _compat.layers_within(model)}


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
    state = mirrored._step_state.adopted
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


def ensure_built(mirrored, x, example, y=None, training=True):
    """Builds the model, optimizers, loss and metrics before a step; then
    the checks that need them built.

    Building in the first step would split an unbuilt model's first
    batch (which may not divide) and create variables inside replicas.
    Everything is built on one device, as the user's model would be;
    the variables then move to the strategy (`_homes`). `example` is a
    small `(x, y, sample_weight)` batch of the input `x`
    (`_inputs.example`), None when it gives none. `y` is the targets the
    labels are checked on (None: the example's); `training` warns, as
    Keras's `fit` does, when there is nothing to train.
    """
    inner = mirrored._inner
    if example is None:
        if not inner.built or not all(
                o.built for o in _homes.optimizers_of(inner)):
            raise ValueError(
                "The wrapped model is not built and keras-mirror cannot "
                "take a batch from this input to build it. Build the model "
                "first (e.g. `model.build(input_shape)`). "
                f"Received: x={type(x).__name__}")
    else:
        build_from_batch(inner, example[0])
    # The labels need the built model only, not its loss and optimizers.
    check_sparse_labels(inner, y if y is not None or example is None
                        else example[1])
    if example is not None:
        build(mirrored, example)
        mirrored.built = True
        mirrored._homes.refresh()
    if training:
        warn_nothing_to_train(mirrored)
    # What the step needs for the model's BatchNorm layers, decided once,
    # before the first step traces (reset by each compile).
    _batchnorm.kinds(mirrored)


def build_model(mirrored, example):
    """Builds an unbuilt model (only) from `example`, for `predict`."""
    if not mirrored._inner.built:
        build_from_batch(mirrored._inner,
                         None if example is None else example[0])
        mirrored._homes.refresh()


def warn_nothing_to_train(mirrored):
    """Keras's own warning for a model without trainable weights.

    Keras's `train_step` warns so and runs the step without an update
    (its metrics and random draws still run); the replicas' step does the
    same. A model's own `train_step` warns itself, if it does.
    """
    if not mirrored._custom_step and not mirrored._inner.trainable_weights:
        warnings.warn("The model does not have any trainable weights.")


def build_from_batch(model, x):
    """Builds an unbuilt model from a batch, as Keras's `fit` does.

    Its `call` runs on symbolic tensors of the batch's shapes and dtypes
    (`_compat.compute_output_spec`), so that nothing it does (a counter's
    `assign`, a metric's update) happens outside the steps: plain `fit`
    runs the model only in its steps. An input that has no symbolic form
    here (ragged, sparse, strings) or a model that cannot be traced so is
    called on the batch, once, in inference mode.
    """
    if model.built:
        return
    try:
        _compat.compute_output_spec(model, _symbolic(x), training=False)
    except Exception:  # noqa: BLE001 - the eager call below says why
        pass
    if not model.built:
        model(x, training=False)


class _NoSymbolicForm(TypeError):
    pass


def _symbolic(x):
    """`x` with each array or dense tensor as a `keras.KerasTensor`."""
    def leaf(value):
        if value is None:
            return None
        if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)) or (
                not hasattr(value, "shape")):
            raise _NoSymbolicForm(type(value).__name__)
        return keras.KerasTensor(tuple(value.shape),
                                 keras.backend.standardize_dtype(value.dtype))

    return keras.tree.map_structure(leaf, x)


def _shape(value):
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(
        None if d is None else int(d) for d in shape)


def _is_sparse_loss(loss):
    name = loss if isinstance(loss, str) else getattr(
        loss, "__name__", None) or getattr(getattr(
            loss, "fn", None), "__name__", None)
    return name == "sparse_categorical_crossentropy" or isinstance(
        loss, keras.losses.SparseCategoricalCrossentropy)


def _output_shape(model):
    """The single output's shape, or None (several outputs, unknown)."""
    try:
        shape = model.output_shape
    except (AttributeError, ValueError, RuntimeError):
        return None
    if isinstance(shape, tuple) and shape and all(
            d is None or isinstance(d, int) for d in shape):
        return shape
    return None


def check_sparse_labels(model, y):
    """For a sparse cross-entropy on a built model: a class index per
    output position, in range. Without it a one-hot `y` or a label beyond
    the model's classes fails inside a traced replica step, naming
    nothing."""
    if y is None or isinstance(y, (list, tuple, dict)) or \
            not _is_sparse_loss(getattr(model, "loss", None)):
        return
    shape = _shape(y)
    if shape is None:
        return
    output = _output_shape(model)
    # One class index per output position (a sequence model's targets are
    # (batch, steps)): wrong only when `y` has the output's own rank with
    # more than one value on the class axis, as a one-hot target has.
    if output is not None and len(shape) == len(output) and \
            shape[-1] not in (None, 1):
        raise ValueError(
            "`y` must hold one class index per output position (shape "
            f"{output[:-1]} or {output[:-1] + (1,)}) for the loss "
            "sparse_categorical_crossentropy; "
            "one-hot targets go with categorical_crossentropy. "
            f"Received: y.shape={shape}")
    classes = output[-1] if output is not None and isinstance(
        output[-1], int) else None
    if classes is None or not isinstance(y, np.ndarray) or not y.size:
        return
    low, high = int(np.min(y)), int(np.max(y))
    if low < 0 or high >= classes:
        raise ValueError(
            f"`y` must hold class indices in [0, {classes}) for the "
            f"model's {classes} outputs and the loss "
            "sparse_categorical_crossentropy. "
            f"Received: y with labels from {low} to {high}")


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
