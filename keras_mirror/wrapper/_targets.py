"""Eager checks of targets and sample weights against the compiled loss.

Without them, a `sample_weight` of shape (B, 3) for a (B, 1) target, a `y`
of shape (B, 5) for a sparse cross-entropy or a label beyond the model's
classes fail inside a traced replica step with errors that name nothing
(`as_list() is not defined on an unknown TensorShape`). Each check reads
shapes, or the values of one batch already in memory: cheap.
"""

import keras
import numpy as np

_SPARSE = ("sparse_categorical_crossentropy",)


def _shape(value):
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(
        None if d is None else int(d) for d in shape)


def check_sample_weight_type(sample_weight):
    """`sample_weight` must be arrays (or None), not a string or a dict of
    class weights: one array, or (a multi-output model's per-output
    weights, as Keras takes them) a list or dict of arrays or None."""
    if sample_weight is None or _shape(sample_weight) is not None:
        return
    if isinstance(sample_weight, (list, tuple, dict)) and all(
            leaf is None or _shape(leaf) is not None
            for leaf in keras.tree.flatten(sample_weight)):
        return
    raise ValueError(
        "`sample_weight` must be an array of weights, one per row (or one "
        "per element of `y`), a list or dict of such arrays (one per "
        "output), or None; use `class_weight` for weights by "
        f"class. Received: sample_weight={sample_weight!r}")


def _fits(weight, target):
    """Keras's rule: a weight per row, or per element of the target (or of
    its leading, non-class axes)."""
    extra = weight[1:]
    return all(d in (None, 1) for d in extra) or \
        _same(extra, target[1:]) or _same(extra, target[1:-1])


def _same(a, b):
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b))


def check_sample_weight_shape(y, sample_weight, name="sample_weight"):
    """Single-output targets only: a shape Keras can weight the loss by."""
    y_shape, w_shape = _shape(y), _shape(sample_weight)
    if y_shape is None or w_shape is None or not w_shape:
        return
    if not _fits(w_shape, y_shape):
        raise ValueError(
            f"`{name}` must hold one weight per row (shape (batch,)) or "
            "one per element of the target `y`. "
            f"Received: {name}.shape={w_shape} with y.shape={y_shape}")


def _is_sparse_loss(loss):
    name = loss if isinstance(loss, str) else getattr(
        loss, "__name__", None) or getattr(getattr(
            loss, "fn", None), "__name__", None)
    return name in _SPARSE or isinstance(
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


def _classes(model):
    shape = _output_shape(model)
    if shape is not None and isinstance(shape[-1], int):
        return shape[-1]
    return None


def check_sparse_labels(model, y):
    """For a sparse cross-entropy: a class index per row, in range."""
    if y is None or not _is_sparse_loss(getattr(model, "loss", None)):
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
    classes = _classes(model)
    if classes is None or not isinstance(y, np.ndarray) or not y.size:
        return
    low, high = int(np.min(y)), int(np.max(y))
    if low < 0 or high >= classes:
        raise ValueError(
            f"`y` must hold class indices in [0, {classes}) for the "
            f"model's {classes} outputs and the loss "
            "sparse_categorical_crossentropy. "
            f"Received: y with labels from {low} to {high}")


def check(model, x, y, sample_weight):
    """All of the above, on arrays or on one batch."""
    check_sample_weight_type(sample_weight)
    if not isinstance(y, (list, tuple, dict)):
        check_sample_weight_shape(y, sample_weight)
        check_sparse_labels(model, y)
