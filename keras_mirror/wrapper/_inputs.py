"""The input as Keras will read it: its steps, and a batch to build from.

The fourth stage of the pass over the input (`_fit_input`), after the
batch mode (`_grouping`): the number of steps an epoch takes, and a small
`(x, y, sample_weight)` batch of the input from which the model, its
compiled loss and metrics and its optimizers are built before the first
step (`_compile.ensure_built`), taken from a dataset's element spec or
arrays' shapes where they say enough: nothing read.
"""

import collections.abc
import math

import keras
import numpy as np
import tensorflow as tf

from keras_mirror.distribute import _rows
from keras_mirror.wrapper import _first


def prepare(mirrored, x, y, sample_weight, batch_size, steps_per_epoch,
            first, validation_split=0.0, build=True):
    """(steps per epoch or None, a batch to build from or None) of `x`,
    adapted to the batch mode; `first` is the pass's `First` of `x`.
    Without `build` (`predict` of a built model) no batch is taken."""
    steps = count_steps(x, batch_size, steps_per_epoch, validation_split)
    if not build:
        return steps, None
    return steps, first_batch(x, y, sample_weight,
                              shapes_only=mirrored._inner.built,
                              first=first)


def _zeros_like_spec(spec):
    """Zeros of `spec`'s dtype and shape, an unknown batch size read as 1.

    Returns None unless `spec` is a `tf.TensorSpec` whose dimensions after
    the first are all known.
    """
    if type(spec) is not tf.TensorSpec or spec.shape.rank is None:
        return None
    dims = spec.shape.as_list()
    if any(d is None for d in dims[1:]):
        return None
    if dims and dims[0] is None:
        dims[0] = 1
    return tf.zeros(dims, spec.dtype)


def batch_from_spec(dataset):
    """A batch of zeros shaped like `dataset`'s elements, or None.

    Building from the element spec reads nothing from the dataset: reading
    its first element an extra time would run the pipeline once more and,
    on a `.cache()` pipeline, make TensorFlow discard a partial cache with
    a warning that plain Keras never causes. None when some leaf is not a
    dense tensor of known shape (ragged, sparse, a variable-size image),
    where only a real element shows what the model will receive.
    """
    spec = dataset.element_spec
    leaves = tf.nest.flatten(spec)
    zeros = [_zeros_like_spec(leaf) for leaf in leaves]
    if not leaves or any(z is None for z in zeros):
        return None
    return tf.nest.pack_sequence_as(spec, zeros)


def _dense_spec(dataset):
    """`dataset`'s element spec when every leaf is a dense `tf.TensorSpec`."""
    spec = dataset.element_spec
    leaves = tf.nest.flatten(spec)
    if leaves and all(type(leaf) is tf.TensorSpec for leaf in leaves):
        return spec
    return None


def first_batch(x, y=None, sample_weight=None, shapes_only=False,
                first=None):
    """A small `(x, y, sample_weight)` batch of the input, or None.

    Used to build an unbuilt model and the compiled loss and metrics before
    the first step, so that nothing is created inside a replica. A dataset
    gives a batch of zeros built from its element spec (`batch_from_spec`),
    without reading it; with `shapes_only` (a built model, whose loss and
    metrics build from shapes), a spec with open dimensions is returned as
    it is (`tf.TensorSpec`s), unread, and so are arrays' shapes. Only a
    dataset whose spec leaves shapes open for an unbuilt model, or that
    holds ragged or sparse leaves, is read: its first element, through
    `first` (the pass's `First` of the input as the user gave it), which
    reads it at most once for every stage.
    """
    if first is None:
        first = _first.First(x)
        if first.kind == "generator":
            return None  # reading it here would lose an element
    if first.kind == "dataset":
        element = batch_from_spec(x)
        if element is None and shapes_only:
            element = _dense_spec(x)
        if element is None:
            element = first.read()
        return keras.utils.unpack_x_y_sample_weight(element)
    if first.kind in ("pydataset", "generator"):
        return keras.utils.unpack_x_y_sample_weight(first.read())
    if first.kind == "arrays":
        return tf.nest.map_structure(
            lambda t: None if t is None else _head(t, shapes_only),
            (x, y, sample_weight))
    return None


def _head(t, shapes_only):
    """One row of an array, or (`shapes_only`) its spec: nothing read."""
    if shapes_only and isinstance(t, (np.ndarray, tf.Tensor)):
        return tf.TensorSpec((None,) + tuple(t.shape[1:]),
                             tf.as_dtype(t.dtype))
    return _rows.head(t, 1)


def count_steps(x, batch_size, steps_per_epoch, validation_split=0.0):
    """The number of steps an epoch takes, or None when unknown."""
    if steps_per_epoch is not None:
        return steps_per_epoch
    if isinstance(x, tf.data.Dataset):
        n = int(x.cardinality())
        return n if n >= 0 else None
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches
    leaves = [t for t in tf.nest.flatten(x) if t is not None]
    if leaves and _rows.is_array(x):
        rows = int(leaves[0].shape[0])
        if validation_split:
            rows = int(math.floor(rows * (1.0 - validation_split)))
        return math.ceil(rows / (batch_size or 32))
    return None


def is_generator(x):
    """A Python generator or iterator (not arrays, a dataset or PyDataset)."""
    return isinstance(x, collections.abc.Iterator) and not isinstance(
        x, (tf.data.Dataset, keras.utils.PyDataset)) and not _rows.is_array(x)


