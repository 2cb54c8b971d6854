"""Eager checks of `MirroredModel.fit`'s arguments, with Keras-style errors.

Each check names the argument in backticks, says what was expected and ends
with `Received: name=value`, so that a mistake fails before the first step
with a message that points at it, instead of deep inside a traced replica
step (or, for an empty dataset or an oversized `steps_per_epoch`, not at
all). `docs/errors.md` lists every error and `tests/test_errors.py` asserts
each message.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_mirror.distribute import _input_fn
from keras_mirror.wrapper import _arguments
from keras_mirror.wrapper import _inputs
from keras_mirror.wrapper import _targets

check_choice = _arguments.check_choice


_positive_int = _arguments.positive_int


def _rows(t):
    return int(t.shape[0]) if len(t.shape) else None


def _check_lengths(x, y, sample_weight):
    """Arrays: `x`, `y` and `sample_weight` must have the same rows."""
    parts = {"x": x, "y": y, "sample_weight": sample_weight}
    rows = {}
    for name, value in parts.items():
        if value is None or not _inputs.is_array(value):
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
        raise ValueError(
            "`x` must hold at least one example. "
            f"Received: x with shape {tuple(_inputs.first_leaf(x).shape)}"
        )
    for name in ("y", "sample_weight"):
        if name in rows and "x" in rows and rows[name] != rows["x"]:
            raise ValueError(
                f"`{name}` must have as many rows as `x` ({rows['x']}). "
                f"Received: {name} with {rows[name]} rows "
                f"(len(x)={rows['x']}, len({name})={rows[name]})"
            )


def _cardinality(dataset):
    return int(dataset.cardinality())


def _check_dataset(x, steps_per_epoch, batch_mode, num_replicas):
    """A dataset must yield, hold enough batches and group evenly."""
    card = _cardinality(x)
    # A dataset of unknown size is not read ahead to see whether it is
    # empty (plain Keras reads each element once): the first step says so
    # (`steps._probing`).
    if card == 0:
        raise empty_dataset(x)
    if card < 0:
        return
    if batch_mode == "per_replica":
        _check_groups(card, num_replicas)
    steps = -(-card // num_replicas) if batch_mode == "per_replica" else card
    if steps_per_epoch is not None and steps_per_epoch > steps:
        raise ValueError(
            f"`steps_per_epoch` must be at most the {steps} step(s) that "
            "the finite dataset `x` provides (repeat it with "
            "`dataset.repeat()` for more). "
            f"Received: steps_per_epoch={steps_per_epoch!r}"
        )


empty_dataset = _inputs.empty_dataset


def _check_groups(batches, num_replicas):
    if batches % num_replicas:
        raise ValueError(
            "`batch='per_replica'` needs the number of batches of `x` to be "
            f"a multiple of the replica count ({num_replicas}): one step "
            f"takes {num_replicas} batches and the last group would be "
            f"short. Received: x with {batches} batches"
        )


def _x_and_y_spec(x):
    """(x structure, has targets) of an input, or (None, None) if unknown."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        if isinstance(spec, tuple):
            return spec[0], len(spec) > 1
        return spec, False
    return None, None


def _check_targets(model, x, y):
    if getattr(model, "loss", None) is None:
        return
    if _inputs.is_array(x) and y is None:
        raise ValueError(
            "`y` must be given: the model was compiled with a loss "
            f"({_name(model.loss)}), which needs targets. Received: y=None"
        )
    _, has_targets = _x_and_y_spec(x)
    if has_targets is False:
        raise ValueError(
            "`x` must yield `(inputs, targets)` or `(inputs, targets, "
            "sample_weights)` tuples: the model was compiled with a loss "
            f"({_name(model.loss)}), which needs targets. "
            f"Received: x with element_spec={x.element_spec!r}"
        )


def _name(obj):
    return getattr(obj, "__name__", None) or repr(obj)


def _expected_inputs(model):
    """The model's input structure of `KerasTensor`s, or None."""
    try:
        if isinstance(model, keras.Sequential):
            inputs = model.inputs
            return inputs[0] if inputs and len(inputs) == 1 else None
        return model.input
    except (AttributeError, ValueError):
        return None


def _check_one_shape(name, value, expected):
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(expected, "shape"):
        return
    dtype = getattr(value, "dtype", None)
    if _inputs.is_strings(dtype) and not _inputs.is_strings(expected.dtype):
        raise ValueError(
            f"`{name}` must hold numbers for the model's input of dtype "
            f"{expected.dtype}. Received: {name} with dtype={dtype!r}")
    if not _inputs.fits(shape, expected.shape):
        raise ValueError(
            f"`{name}` must have the shape {tuple(expected.shape)} "
            "(None: any size) of the model's input. "
            f"Received: {name}.shape={tuple(shape)}"
        )


def _check_input_structure(model, x, name="x"):
    expected = _expected_inputs(model)
    if expected is None or x is None:
        return
    spec, _ = _x_and_y_spec(x)
    given = spec if spec is not None else x
    if not (_inputs.is_array(x) or spec is not None):
        return
    if isinstance(expected, dict):
        if not isinstance(given, dict):
            raise ValueError(
                f"`{name}` must be a dict with the keys {sorted(expected)} "
                "of the model's inputs. "
                f"Received: {name}={type(given).__name__}"
            )
        missing = sorted(set(expected) - set(given))
        if missing:
            raise ValueError(
                f"`{name}` must have the keys {sorted(expected)} of the "
                f"model's inputs; {missing} missing. "
                f"Received: {name} with keys {sorted(given)}"
            )
        for key, tensor in expected.items():
            _check_one_shape(f"{name}[{key!r}]", given[key], tensor)
    elif not isinstance(expected, (list, tuple)) and not isinstance(
            given, (dict, list, tuple)):
        _check_one_shape(name, given, expected)


def check_fit_inputs(mirrored, x, y, batch_size, steps_per_epoch,
                     kwargs=None, epochs=1, callbacks=None):
    """Validates `fit`'s input arguments before any step runs."""
    kwargs = kwargs or {}
    sample_weight = kwargs.get("sample_weight")
    _positive_int("batch_size", batch_size)
    _positive_int("steps_per_epoch", steps_per_epoch)
    _arguments.check_fit_arguments(epochs, callbacks, kwargs)
    _targets.check_sample_weight_type(sample_weight)
    if isinstance(x, tf.data.Dataset):
        _check_dataset(x, steps_per_epoch, mirrored.batch_mode,
                       mirrored.num_replicas)
    elif isinstance(x, keras.utils.PyDataset):
        if mirrored.batch_mode == "per_replica" and x.num_batches:
            _check_groups(x.num_batches, mirrored.num_replicas)
    else:
        _check_values("x", x)
        _check_values("y", y)
        _check_lengths(x, y, sample_weight)
        _targets.check(mirrored._inner, x, y, sample_weight)
    if not mirrored._custom_step:  # its own `train_step` decides its data
        _check_targets(mirrored._inner, x, y)
    _check_input_structure(mirrored._inner, x)
    warn_idle_replicas(mirrored, x, batch_size)


def warn_nothing_to_train(mirrored):
    """Keras's own warning for a model without trainable weights.

    Keras's `train_step` warns so and runs the step without an update
    (its metrics and random draws still run); the replicas' step does the
    same. A model's own `train_step` warns itself, if it does.
    """
    if not mirrored._custom_step and not mirrored._inner.trainable_weights:
        warnings.warn("The model does not have any trainable weights.")


def check_built_model(mirrored, x, y):
    """Validates what needs a built model: the labels for the loss; warns
    as Keras does when there is nothing to train."""
    inner = mirrored._inner
    warn_nothing_to_train(mirrored)
    if _inputs.is_array(x):  # the labels' range needs the built outputs
        _targets.check_sparse_labels(inner, y)


# -- issue 16: more inputs, checked before the first step -----------------

def _check_values(name, value):
    """`value` (x or y) must be numbers: no string or object data."""
    if name != "y":
        _input_fn.check_input(name, value)
    if isinstance(value, (str, bytes)):
        raise ValueError(
            f"`{name}` must be arrays, a `tf.data.Dataset`, a "
            "`keras.utils.PyDataset` or a generator, not a string. "
            f"Received: {name}={_short(value)}")
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


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_class_weight(class_weight):
    if class_weight is None:
        return
    if not isinstance(class_weight, dict) or not all(
            isinstance(k, (int, np.integer)) and not isinstance(k, bool)
            for k in class_weight):
        raise ValueError(
            "`class_weight` must be a dict mapping class indices (ints) to "
            f"weights. Received: class_weight={_short(class_weight)}")


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


def check_predict_inputs(x, batch_size):
    """`predict`'s `x` and `batch_size`, before any step."""
    _positive_int("batch_size", batch_size)
    _check_values("x", x)


def check_inputs(mirrored, x, y=None, sample_weight=None, name="x",
                 batch_size=None, first=None):
    """Validates one input (fit's, evaluate's, `*_on_batch`'s, or
    `validation_data`) before any step: values, rows, targets and the
    model's input shape; for a dataset or generator, its first batch
    (read only when its spec says too little, through `first`)."""
    _positive_int("batch_size", batch_size)
    _targets.check_sample_weight_type(sample_weight)
    _check_values("x", x)
    _check_values("y", y)
    batch = None
    if isinstance(x, tf.data.Dataset) or _inputs.is_generator(x):
        batch = _inputs.first_batch(x, shapes_only=True, first=first)
    elif _inputs.is_array(x):
        _check_lengths(x, y, sample_weight)
        batch = (x, y, sample_weight)
    if batch is None:
        return
    _check_values("y", batch[1])
    _targets.check(mirrored.model, *batch)
    if not _inputs.is_array(x):
        _check_batch_rows(name, *batch)
    model = mirrored.model
    if getattr(model, "built", False):
        _check_input_structure(model, batch[0], name)
        _inputs.expect_input_shapes(x, _expected_inputs(model))


def check_more_fit_inputs(mirrored, x, validation_data, kwargs, first=None,
                          validation_first=None):
    """`fit`'s checks that need the adapted input: a generator's or
    dataset's first batch (`first`, read at most once), `class_weight`,
    and `validation_data`, which Keras would otherwise reach only after a
    whole epoch of training."""
    _check_class_weight(kwargs.get("class_weight"))
    if isinstance(x, tf.data.Dataset) or _inputs.is_generator(x):
        check_inputs(mirrored, x, first=first)
    if validation_data is None:
        return
    if isinstance(validation_data, (tf.data.Dataset, keras.utils.PyDataset)):
        if isinstance(validation_data, tf.data.Dataset):
            check_inputs(mirrored, validation_data, name="validation_data",
                         first=validation_first)
        return
    if not isinstance(validation_data, (tuple, list)) or \
            len(validation_data) not in (2, 3):
        raise ValueError(
            "`validation_data` must be a tuple `(x_val, y_val)` or "
            "`(x_val, y_val, val_sample_weight)`, a `tf.data.Dataset` or a "
            "`keras.utils.PyDataset`. Received: "
            f"validation_data={_short(validation_data)}")
    vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(
        tuple(validation_data))
    _check_values("validation_data", vx)
    _check_values("y", vy)
    if _inputs.is_array(vx):
        _check_lengths(vx, vy, vsw)
        _check_input_structure(mirrored.model, vx, "validation_data")


def _global_rows(x, batch_size):
    """Rows of a full global batch of `x` (arrays or a dataset), or None."""
    if isinstance(x, tf.data.Dataset):  # a static batch size only
        spec, _ = _x_and_y_spec(x)
        leaves = tf.nest.flatten(spec)
        shape = getattr(leaves[0], "shape", None) if leaves else None
        if shape is None or not len(shape) or shape[0] is None:
            return None
        return int(shape[0])
    if _inputs.is_array(x):
        return min(batch_size or 32, _inputs.num_rows(x))
    return None


def warn_idle_replicas(mirrored, x, batch_size):
    """Warns when most replicas would get empty shards every step.

    With `batch="global"`, a global batch of `B` rows over `N > B`
    replicas leaves `N - B` shards empty; they still trace and run the
    step and join every all-reduce. On CPUs tracing grows with `N`
    (64 logical CPUs: about 2 s per replica on the `"strategy"` path), so
    `N` far above `B` costs minutes and buys nothing.
    """
    if mirrored.batch_mode != "global":
        return
    n = mirrored.num_replicas
    rows = _global_rows(x, batch_size)
    if rows is None or n <= 2 * rows:
        return
    warnings.warn(
        f"{n} replicas for a global batch of {rows} rows: {n - rows} "
        "replicas get an empty shard every step and only add tracing "
        "and synchronisation time (it grows with the replica count). "
        "Pass fewer `devices` or a larger `batch_size`. "
        f"Received: batch_size={rows} with {n} replicas",
        UserWarning, stacklevel=3)
