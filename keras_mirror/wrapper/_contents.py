"""The input's contents against the model and its loss, before any step.

The second stage of the pass over the input (`_fit_input`), after the
arguments (`_validate`): values (numbers, or strings for a model that
takes them), rows, targets and sample weights, and the model's input
structure and shapes, on arrays or on one batch: a dataset's element
spec, or the first element of a generator, or of a dataset whose spec
leaves shapes open (ragged or sparse leaves), read at most once through
the pass's `_first.First`. Without them, a `sample_weight` of shape (B, 3)
for a (B, 1) target or a missing input key fail inside a traced replica
step with errors that name nothing (`as_list() is not defined on an
unknown TensorShape`).
"""

import collections.abc

import keras
import numpy as np
import tensorflow as tf

from keras_mirror.wrapper import _rebuild


def _arrays(x):
    return x is not None and all(
        isinstance(t, (np.ndarray, tf.Tensor, tf.SparseTensor,
                       tf.RaggedTensor))
        for t in tf.nest.flatten(x) if t is not None)


def _generator(x):
    return isinstance(x, collections.abc.Iterator) and not isinstance(
        x, (tf.data.Dataset, keras.utils.PyDataset)) and not _arrays(x)


def check_fit(mirrored, x, y, sample_weight, validation_data, first,
              validation_first):
    """`fit`'s input and `validation_data`, which Keras would otherwise
    reach only after a whole epoch of training."""
    check(mirrored, x, y, sample_weight, first,
          targets=not mirrored._custom_step)
    if isinstance(validation_data, tf.data.Dataset):
        check(mirrored, validation_data, first=validation_first,
              name="validation_data")
    elif validation_data is not None and not isinstance(
            validation_data, keras.utils.PyDataset):
        vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(
            tuple(validation_data))
        _check_values("validation_data", vx)
        _check_values("y", vy)
        if _arrays(vx):
            _check_lengths(vx, vy, vsw)
            _check_structure(mirrored.model, vx, "validation_data")


def check(mirrored, x, y=None, sample_weight=None, first=None, name="x",
          targets=False):
    """One input (`fit`'s, `evaluate`'s, `*_on_batch`'s or
    `validation_data`): values, rows, targets (with `targets`, whether the
    compiled loss has them) and the model's input shape; for a dataset or
    a generator, on its first batch."""
    model = mirrored.model
    _check_values(name, x)
    _check_values("y", y)
    if targets:
        _check_targets(model, x, y)
    batch = None
    if isinstance(x, tf.data.Dataset) or _generator(x):
        batch = _first_batch(x, first)
    elif _arrays(x):
        _check_lengths(x, y, sample_weight)
        batch = (x, y, sample_weight)
    if batch is None:
        return
    _check_values("y", batch[1])
    if not isinstance(batch[1], (list, tuple, dict)):
        _check_sample_weight_shape(batch[1], batch[2])
    if not _arrays(x):
        _check_batch_rows(name, *batch)
    _check_structure(model, batch[0], name)


def check_predict(x):
    """`predict`'s and `predict_on_batch`'s `x`: numbers or strings."""
    _check_values("x", x)


def _first_batch(x, first):
    """`(x, y, sample_weight)` of one batch, as shapes where the spec says
    enough (nothing read), else the first element (`first`)."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        if all(type(s) is tf.TensorSpec and s.shape.rank is not None
               for s in tf.nest.flatten(spec)):
            return keras.utils.unpack_x_y_sample_weight(spec)
    return keras.utils.unpack_x_y_sample_weight(first.read())


def _rows(t):
    return int(t.shape[0]) if len(t.shape) else None


def _check_lengths(x, y, sample_weight):
    """Arrays: `x`, `y` and `sample_weight` must have the same rows."""
    parts = {"x": x, "y": y, "sample_weight": sample_weight}
    rows = {}
    for name, value in parts.items():
        if value is None or not _arrays(value):
            continue
        for leaf in tf.nest.flatten(value):
            if leaf is not None and _rows(leaf) is not None:
                rows.setdefault(name, _rows(leaf))
                if _rows(leaf) != rows[name]:
                    raise ValueError(
                        f"Every array in `{name}` must have the same number "
                        f"of rows. Received: {name} with row counts "
                        f"{[_rows(t) for t in tf.nest.flatten(value)]}"
                    )
    if "x" in rows and rows["x"] == 0:
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        raise ValueError(
            "`x` must hold at least one example. "
            f"Received: x with shape {tuple(first.shape)}"
        )
    for name in ("y", "sample_weight"):
        if name in rows and "x" in rows and rows[name] != rows["x"]:
            raise ValueError(
                f"`{name}` must have as many rows as `x` ({rows['x']}). "
                f"Received: {name} with {rows[name]} rows "
                f"(len(x)={rows['x']}, len({name})={rows[name]})"
            )


def _check_values(name, value):
    """`value` (x or y) must be numbers: no object data; `y` no strings."""
    for leaf in tf.nest.flatten(value):
        dtype = getattr(leaf, "dtype", None)
        if isinstance(leaf, np.ndarray) and dtype.kind == "O" and not all(
                isinstance(v, (str, bytes)) for v in leaf.ravel()):
            raise ValueError(
                f"`{name}` must hold numbers (or strings), not Python "
                "objects: a NumPy array of dtype object usually holds rows "
                "of different lengths. Pad them to one shape. "
                f"Received: {name} with dtype=object")
        if name == "y" and isinstance(leaf, np.ndarray) and \
                dtype.kind in "USO":
            raise ValueError(
                "`y` must hold numbers, which a loss can compare to "
                "predictions. Encode string labels as integers first. "
                f"Received: y with dtype={dtype}")


def _name(obj):
    return getattr(obj, "__name__", None) or repr(obj)


def _check_targets(model, x, y):
    if getattr(model, "loss", None) is None:
        return
    if _arrays(x) and y is None:
        raise ValueError(
            "`y` must be given: the model was compiled with a loss "
            f"({_name(model.loss)}), which needs targets. Received: y=None"
        )
    if isinstance(x, tf.data.Dataset) and not (
            isinstance(x.element_spec, tuple) and len(x.element_spec) > 1):
        raise ValueError(
            "`x` must yield `(inputs, targets)` or `(inputs, targets, "
            "sample_weights)` tuples: the model was compiled with a loss "
            f"({_name(model.loss)}), which needs targets. "
            f"Received: x with element_spec={x.element_spec!r}"
        )


def _shape(value):
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(
        None if d is None else int(d) for d in shape)


def _same(a, b):
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b))


def _check_sample_weight_shape(y, sample_weight):
    """Single-output targets only: a shape Keras can weight the loss by:
    a weight per row, or per element of the target (or of its leading,
    non-class axes)."""
    y_shape, w_shape = _shape(y), _shape(sample_weight)
    if y_shape is None or w_shape is None or not w_shape:
        return
    extra = w_shape[1:]
    if not (all(d in (None, 1) for d in extra) or _same(extra, y_shape[1:])
            or _same(extra, y_shape[1:-1])):
        raise ValueError(
            "`sample_weight` must hold one weight per row (shape (batch,)) "
            "or one per element of the target `y`. "
            f"Received: sample_weight.shape={w_shape} with y.shape={y_shape}")


def _check_batch_rows(name, x, y, sample_weight):
    """One batch (a dataset's or generator's first): same rows in each."""
    rows = {}
    for part, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        for leaf in tf.nest.flatten(value):
            shape = getattr(leaf, "shape", None)
            if shape is not None and len(shape) and shape[0] is not None:
                rows.setdefault(part, int(shape[0]))
    for part in ("y", "sample_weight"):
        if part in rows and "x" in rows and rows[part] != rows["x"]:
            raise ValueError(
                f"Each batch of `{name}` must have as many {part} rows as "
                f"input rows ({rows['x']}). Received: a batch with "
                f"{rows[part]} {part} rows and {rows['x']} input rows")


def _check_one_shape(name, value, expected):
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(expected, "shape"):
        return
    dtype = getattr(value, "dtype", None)
    if _rebuild.is_strings(dtype) and not _rebuild.is_strings(
            expected.dtype):
        raise ValueError(
            f"`{name}` must hold numbers for the model's input of dtype "
            f"{expected.dtype}. Received: {name} with dtype={dtype!r}")
    if not _rebuild.fits(shape, expected.shape):
        raise ValueError(
            f"`{name}` must have the shape {tuple(expected.shape)} "
            "(None: any size) of the model's input. "
            f"Received: {name}.shape={tuple(shape)}"
        )


def _check_structure(model, x, name="x"):
    """`x` (arrays, or one batch's inputs) against a built model's inputs."""
    expected = _rebuild.expected_inputs(model)
    if expected is None or x is None:
        return
    if isinstance(expected, dict):
        if not isinstance(x, dict):
            raise ValueError(
                f"`{name}` must be a dict with the keys {sorted(expected)} "
                "of the model's inputs. "
                f"Received: {name}={type(x).__name__}"
            )
        missing = sorted(set(expected) - set(x))
        if missing:
            raise ValueError(
                f"`{name}` must have the keys {sorted(expected)} of the "
                f"model's inputs; {missing} missing. "
                f"Received: {name} with keys {sorted(x)}"
            )
        for key, tensor in expected.items():
            _check_one_shape(f"{name}[{key!r}]", x[key], tensor)
    elif not isinstance(expected, (list, tuple)) and not isinstance(
            x, (dict, list, tuple)):
        _check_one_shape(name, x, expected)
