"""The checks of the arguments and of the input's form: nothing read.

The first stage of the pass over the input (`_fit_input`): each check
names the argument in backticks, says what was expected and ends with
`Received: name=value`, so that a mistake fails before the first step
with a message that points at it, instead of deep inside a traced
replica step (or, for an empty dataset or an oversized
`steps_per_epoch`, not at all). The input's contents against the model
come next (`_contents`). `docs/errors.md` lists every error and
`tests/test_errors.py` asserts each message.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.distribute import _rows
from keras_mirror.wrapper import _arguments
from keras_mirror.wrapper import _first

check_choice = _arguments.check_choice
_positive_int = _arguments.positive_int
empty_dataset = _first.empty_dataset


def _arrays(x):
    return x is not None and all(
        isinstance(t, (np.ndarray, tf.Tensor, tf.SparseTensor,
                       tf.RaggedTensor))
        for t in tf.nest.flatten(x) if t is not None)


def check_fit(mirrored, x, y, batch_size, epochs, steps_per_epoch,
              callbacks, validation_data, kwargs):
    """`fit`'s arguments and what its input says without reading it.

    `x` is what `_virtual_shards.fit_input` returned: with
    `worker_input="shard"`, a dataset or function is read in virtual
    shards, and only another `x` must be one an adapter reads.
    """
    refuse_validation(validation_data)
    check_input("x", x)
    _check_some_input(mirrored._inner, x)
    _check_string(x)
    _rows.refuse_endless("x", x, "steps_per_epoch", steps_per_epoch)
    _rows.refuse_endless("validation_data", validation_data, "validation_steps",
                   kwargs.get("validation_steps"))
    _positive_int("batch_size", batch_size)
    _positive_int("steps_per_epoch", steps_per_epoch)
    _arguments.check_fit_arguments(epochs, callbacks, kwargs)
    check_sample_weight_type(kwargs.get("sample_weight"))
    if isinstance(x, keras.utils.PyDataset):
        if mirrored.batch_mode == "per_replica" and x.num_batches:
            _check_groups(x.num_batches, mirrored.num_replicas)
    _warn_idle_replicas(mirrored, x, batch_size)
    _check_class_weight(kwargs.get("class_weight"))
    _check_validation_form(validation_data)
    if isinstance(x, tf.data.Dataset):  # last: it walks the pipeline
        _check_dataset(mirrored, x, steps_per_epoch)


def check_evaluate(mirrored, x, batch_size, kwargs):
    """`evaluate`'s arguments and what its input says without reading it."""
    check_input("x", x)
    _check_some_input(mirrored._inner, x)
    _check_string(x)
    _rows.refuse_endless("x", x, "steps", kwargs.get("steps"))
    _positive_int("batch_size", batch_size)
    check_sample_weight_type(kwargs.get("sample_weight"))
    refuse_hint("x", x)


def check_predict(x, batch_size, kwargs):
    """`predict`'s `x` and `batch_size`, before any step."""
    check_input("x", x)
    _positive_int("batch_size", batch_size)
    _check_string(x)
    _rows.refuse_endless("x", x, "steps", kwargs.get("steps"))
    refuse_hint("x", x)


def check_batch(mirrored, x, sample_weight=None, predict=False):
    """One global batch of `*_on_batch` (with `predict`, of
    `predict_on_batch`)."""
    if not predict:
        check_input("x", x)
    _check_some_input(mirrored._inner, x)
    if not predict:
        _check_string(x)
        check_sample_weight_type(sample_weight)


def refuse_unread(name, x):
    """Refuses an `x` that nothing will read (`check_input`, `refuse_hint`)
    where no virtual shards read it."""
    check_input(name, x)
    refuse_hint(name, x)


def refuse_validation(validation_data):
    """`fit`'s `validation_data`: no `SHARD_HINT` (only `x` is read in
    virtual shards), and an `x_val` that an adapter reads."""
    refuse_hint("validation_data", validation_data)
    if isinstance(validation_data, (tuple, list)) and \
            len(validation_data) in (2, 3):
        check_input("validation_data", validation_data[0])


def check_input(name, value):
    """Refuses an `x` that no input adapter reads: a number, or a function
    where no virtual shards call it (`worker_input="replicate"`,
    `evaluate`, `predict`, `verify`, ...). `None` gets Keras's own error
    (`_check_some_input`)."""
    if isinstance(value, (bool, int, float, complex, np.number, np.bool_)):
        raise ValueError(
            f"`{name}` must be arrays, a `tf.data.Dataset`, a "
            "`keras.utils.PyDataset` or a generator. "
            f"Received: {name}={value!r}")
    if callable(value) and not isinstance(
            value, (tf.data.Dataset, tf.Tensor, tf.Variable)):
        raise ValueError(
            f"`{name}` must be arrays, a `tf.data.Dataset`, a "
            "`keras.utils.PyDataset` or a generator. A function "
            "(`input_fn(input_context)`) is read only by `fit` with "
            "`worker_input='shard'`, in virtual shards; here pass its "
            "dataset, e.g. `input_fn(tf.distribute.InputContext())`. "
            f"Received: {name}={_fn_name(value)}")


def refuse_hint(name, x):
    """Refuses a pipeline holding `shard(SHARD_HINT, SHARD_HINT)` where no
    virtual shards read it: TensorFlow fails at its first read (after a
    whole epoch of training, for `validation_data`)."""
    if isinstance(x, tf.data.Dataset) and _compat.has_shard_hint(x):
        raise ValueError(
            f"`{name}` must not hold `.shard(tf.data.experimental.SHARD_HINT"
            ", tf.data.experimental.SHARD_HINT)` here: only the `x` of `fit` "
            "with `worker_input='shard'` reads it (cut into virtual "
            "shards), and TensorFlow refuses it anywhere else. Remove that "
            "`shard`, or pass `worker_input='shard'` to `MirroredModel`. "
            f"Received: {name} with `shard(SHARD_HINT, SHARD_HINT)`")


def _fn_name(fn):
    return getattr(fn, "__name__", None) or type(fn).__name__


def _check_some_input(model, x):
    """Gives Keras's own error for an `x` that holds no array at all.

    `None`, `[None]` or `{"x": None}` for a required input: Keras's
    Functional model refuses it when its step runs the model
    (`ValueError: The input 'x' is not optional, but None was passed`).
    The model's inputs are standardised here the same way, symbolically
    (nothing runs), so that the same error comes before the wrapper
    counts rows. An `x` that passes (every input optional) is refused
    as having no rows to split.
    """
    if any(t is not None for t in tf.nest.flatten(x)):
        return
    _compat.compute_output_spec(model, x, training=False)
    raise ValueError(
        "`x` holds no array: there are no rows to split across the "
        f"replicas. Received: x={x!r}")


def _check_string(x, name="x"):
    if isinstance(x, (str, bytes)):
        raise ValueError(
            f"`{name}` must be arrays, a `tf.data.Dataset`, a "
            "`keras.utils.PyDataset` or a generator, not a string. "
            f"Received: {name}={short(x)}")


def short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_sample_weight_type(sample_weight):
    """`sample_weight` must be arrays (or None), not a string or a dict of
    class weights: one array, or (a multi-output model's per-output
    weights, as Keras takes them) a list or dict of arrays or None."""
    def shaped(value):
        return getattr(value, "shape", None) is not None

    if sample_weight is None or shaped(sample_weight):
        return
    if isinstance(sample_weight, (list, tuple, dict)) and all(
            leaf is None or shaped(leaf)
            for leaf in keras.tree.flatten(sample_weight)):
        return
    raise ValueError(
        "`sample_weight` must be an array of weights, one per row (or one "
        "per element of `y`), a list or dict of such arrays (one per "
        "output), or None; use `class_weight` for weights by "
        f"class. Received: sample_weight={sample_weight!r}")


def _check_dataset(mirrored, x, steps_per_epoch):
    """A dataset must hold no `SHARD_HINT` outside virtual shards (which
    also makes it count no elements), yield, hold enough batches and
    group evenly."""
    if mirrored.worker_input != "shard":
        refuse_hint("x", x)
    batch_mode, num_replicas = mirrored.batch_mode, mirrored.num_replicas
    card = int(x.cardinality())
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


def _check_groups(batches, num_replicas):
    if batches % num_replicas:
        raise ValueError(
            "`batch='per_replica'` needs the number of batches of `x` to be "
            f"a multiple of the replica count ({num_replicas}): one step "
            f"takes {num_replicas} batches and the last group would be "
            f"short. Received: x with {batches} batches"
        )


def _check_class_weight(class_weight):
    if class_weight is None:
        return
    if not isinstance(class_weight, dict) or not all(
            isinstance(k, (int, np.integer)) and not isinstance(k, bool)
            for k in class_weight):
        raise ValueError(
            "`class_weight` must be a dict mapping class indices (ints) to "
            f"weights. Received: class_weight={short(class_weight)}")


def _check_validation_form(validation_data):
    if validation_data is None or isinstance(
            validation_data, (tf.data.Dataset, keras.utils.PyDataset)):
        return
    if not isinstance(validation_data, (tuple, list)) or \
            len(validation_data) not in (2, 3):
        raise ValueError(
            "`validation_data` must be a tuple `(x_val, y_val)` or "
            "`(x_val, y_val, val_sample_weight)`, a `tf.data.Dataset` or a "
            "`keras.utils.PyDataset`. Received: "
            f"validation_data={short(validation_data)}")
    _check_string(validation_data[0], "validation_data")


def _global_rows(x, batch_size):
    """Rows of a full global batch of `x` (arrays or a dataset), or None."""
    if isinstance(x, tf.data.Dataset):  # a static batch size only
        spec = x.element_spec
        spec = spec[0] if isinstance(spec, tuple) else spec
        leaves = tf.nest.flatten(spec)
        shape = getattr(leaves[0], "shape", None) if leaves else None
        if shape is None or not len(shape) or shape[0] is None:
            return None
        return int(shape[0])
    if _arrays(x):
        leaf = next(t for t in tf.nest.flatten(x) if t is not None)
        return min(batch_size or 32, int(leaf.shape[0]))
    return None


def _warn_idle_replicas(mirrored, x, batch_size):
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
    if not rows or n <= 2 * rows:  # no rows: `_contents` refuses them
        return
    warnings.warn(
        f"{n} replicas for a global batch of {rows} rows: {n - rows} "
        "replicas get an empty shard every step and only add tracing "
        "and synchronisation time (it grows with the replica count). "
        "Pass fewer `devices` or a larger `batch_size`. "
        f"Received: batch_size={rows} with {n} replicas",
        UserWarning, stacklevel=3)
