"""Input handling: a first batch, counting steps, generators.

In `batch="per_replica"` mode each element the input yields is one replica's
batch; a generator's `N` consecutive elements are joined here into one
global batch that the fill rule (`split.fill_sizes`) splits back exactly
(a dataset's and a `PyDataset`'s in `_grouping`).
"""

import collections.abc
import itertools
import math
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import split
from keras_mirror.steps import _slicing


def is_array(x):
    return all(isinstance(t, (np.ndarray, tf.Tensor, tf.SparseTensor,
                              tf.RaggedTensor))
               for t in tf.nest.flatten(x) if t is not None) and x is not None


def first_leaf(x):
    """`x`'s first leaf that is not None (None: an optional input)."""
    return next(t for t in tf.nest.flatten(x) if t is not None)


def check_some_input(model, x):
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


def num_rows(x):
    return int(first_leaf(x).shape[0])


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
    `first` (a `First` of the input as the user gave it), which reads it
    at most once for every caller.
    """
    if first is None and is_generator(x) and x not in _FIRST:
        return None  # not peeked: reading it here would lose an element
    first = first if first is not None else First(x)
    if isinstance(x, tf.data.Dataset):
        element = batch_from_spec(x)
        if element is None and shapes_only:
            element = _dense_spec(x)
        if element is None:
            element = first.read()
        return keras.utils.unpack_x_y_sample_weight(element)
    if isinstance(x, keras.utils.PyDataset) or is_generator(x):
        return keras.utils.unpack_x_y_sample_weight(first.read())
    if x is not None and is_array(x):
        return tf.nest.map_structure(
            lambda t: None if t is None else _head(t, shapes_only),
            (x, y, sample_weight))
    return None


def _head(t, shapes_only):
    """One row of an array, or (`shapes_only`) its spec: nothing read."""
    if shapes_only and isinstance(t, (np.ndarray, tf.Tensor)):
        return tf.TensorSpec((None,) + tuple(t.shape[1:]),
                             tf.as_dtype(t.dtype))
    return _slicing.head(t, 1)


_UNREAD = object()


def empty_dataset(x):
    """The error for an input `x` that yields no batch."""
    return ValueError(
        "`x` must yield at least one batch, but the dataset is empty. "
        f"Received: x={x!r}")


def refuse_endless(name, x, steps_name, steps):
    """Refuses an endless dataset (`repeat()`) without a step count: Keras
    would read it forever, the epoch never ending (TF 2's Keras refused it
    so). `x` may also be a list of the virtual shards of an `input_fn`."""
    shards = x if isinstance(x, list) else [x]
    if steps is None and any(
            isinstance(s, tf.data.Dataset) and
            int(s.cardinality()) == tf.data.INFINITE_CARDINALITY
            for s in shards):
        raise ValueError(
            f"`{steps_name}` must be given for an endless `{name}` (a "
            "dataset repeated forever, `.repeat()`): without it the epoch "
            f"never ends. Pass `{steps_name}=...`, or repeat the dataset a "
            f"finite number of times. Received: {steps_name}=None")


class First:
    """The first element of an input, read at most once.

    Whoever needs real rows before the first step (the per-replica
    capacity of a dataset of dynamic batch size, the build of a model
    whose input shapes the spec leaves open, the checks of a ragged batch,
    a `PyDataset`'s build, the loss reduction probe) reads it here, so
    that the input's first element is read once for all of them. A
    generator's first element is peeked (it then leads the generator that
    `adapt_generator` returns), a dataset's is `take(1)`, a `PyDataset`'s
    is item 0.
    """

    def __init__(self, x):
        self.x = x
        self._element = _UNREAD

    @property
    def was_read(self):
        return self._element is not _UNREAD

    def read(self):
        if self._element is _UNREAD:
            self._element = self._read()
        return self._element

    def _read(self):
        x = self.x
        if is_generator(x) and x in _FIRST:
            return _FIRST[x]  # peeked by `adapt_generator`
        if is_generator(x):
            element = next(x, None)
            if element is None:
                raise ValueError(
                    "`x` must yield at least one batch, but the generator "
                    f"is empty. Received: x={x!r}")
            return element
        if isinstance(x, keras.utils.PyDataset):
            return x[0]
        try:
            return next(iter(x.take(1)))
        except (StopIteration, tf.errors.OutOfRangeError):
            raise empty_dataset(x) from None


def first_x(x, first=None):
    """A small batch of inputs `x` for building an unbuilt model."""
    batch = first_batch(x, first=first)
    return None if batch is None else batch[0]


def count_steps(x, batch_size, steps_per_epoch, validation_split=0.0):
    """The number of steps an epoch takes, or None when unknown."""
    if steps_per_epoch is not None:
        return steps_per_epoch
    if isinstance(x, tf.data.Dataset):
        n = int(x.cardinality())
        return n if n >= 0 else None
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches
    if x is not None and is_array(x):
        rows = num_rows(x)
        if validation_split:
            rows = int(math.floor(rows * (1.0 - validation_split)))
        return math.ceil(rows / (batch_size or 32))
    return None


def is_generator(x):
    """A Python generator or iterator (not arrays, a dataset or PyDataset)."""
    return isinstance(x, collections.abc.Iterator) and not isinstance(
        x, (tf.data.Dataset, keras.utils.PyDataset)) and not is_array(x)


def adapt_generator(generator, num_replicas, batch_mode, first=None):
    """(capacity, a generator) for `MirroredModel`'s input.

    Its first element is read ahead (`first`, a `First` of `generator`),
    so that the model can be built from it before the first step; the
    returned generator yields it first. In `"per_replica"` mode it joins
    `num_replicas` consecutive elements into one global batch; the
    capacity is the first element's rows, and each group must follow the
    fill rule (full batches, then the remainder), as `group_dataset`'s.
    """
    first = (first if first is not None else First(generator)).read()
    holder = {}  # the model's input shapes, once `expect_input_shapes`
    items = _same_shapes(first, itertools.chain([first], generator), holder)
    if batch_mode == "global":
        return None, _peeked(first, items, holder)
    capacity = num_rows(keras.utils.unpack_x_y_sample_weight(first)[0])

    def joined():
        while True:
            group = list(itertools.islice(items, num_replicas))
            if not group:
                return
            yield _join(group, num_replicas, capacity)

    return capacity, _peeked(first, joined(), holder)


def _ranks(element):
    """(structure, each leaf's rank) of one batch."""
    return (tf.nest.map_structure(lambda _: 0, element),
            [len(getattr(t, "shape", ())) for t in tf.nest.flatten(element)])


def fits(shape, expected):
    """Whether inputs of `shape` fit a model input of shape `expected`
    (None: any size), after the rank adjustment a Functional model makes
    (`Functional._adjust_input_rank`): a trailing axis of size 1 is
    dropped, or added where the input declares one."""
    shape, expected = tuple(shape), tuple(expected)
    if len(shape) == len(expected) + 1 and shape[-1] == 1:
        shape = shape[:-1]
    elif len(shape) == len(expected) - 1 and expected[-1] == 1:
        expected = expected[:-1]
    return len(shape) == len(expected) and all(
        e is None or s is None or int(s) == int(e)
        for s, e in zip(shape[1:], expected[1:]))


def is_strings(dtype):
    """Whether `dtype` (NumPy's, TensorFlow's or a Keras name) holds
    strings."""
    if dtype is None:
        return False
    if isinstance(dtype, tf.dtypes.DType) or dtype == "string":
        return dtype in (tf.string, "string")
    try:
        return np.dtype(dtype).kind in "US"
    except TypeError:
        return False


def _same_shapes(first, items, holder):
    """`items`, refusing an element whose structure or ranks differ from
    the first's, or whose inputs do not fit the model's input shapes
    (`holder["x"]`): a traced step would fail on it with an error that
    names nothing. Dimensions the model leaves open may vary."""
    expected = _ranks(first)
    for index, element in enumerate(items):
        if _ranks(element) != expected:
            raise ValueError(
                "Every batch of the generator `x` must have the structure "
                f"and ranks of its first batch: batch {index} differs. "
                f"Received: a batch of ranks {_ranks(element)[1]} after a "
                f"first batch of ranks {expected[1]}")
        inputs = tf.nest.flatten(
            keras.utils.unpack_x_y_sample_weight(element)[0])
        for leaf, shape in zip(inputs, holder.get("x") or ()):
            if leaf is not None and not fits(leaf.shape, shape):
                raise ValueError(
                    f"Every batch of the generator `x` must have the shape "
                    f"{shape} (None: any size) of the model's input: batch "
                    f"{index} differs. Received: x.shape="
                    f"{tuple(leaf.shape)} in batch {index}")
        yield element


def expect_input_shapes(x, inputs):
    """Tells a generator from `adapt_generator` the model's inputs (a
    structure of `KerasTensor`s, or None), whose shapes each batch must
    fit."""
    holder = _HOLDERS.get(x) if is_generator(x) else None
    if holder is not None and inputs is not None:
        holder["x"] = [tuple(t.shape) for t in tf.nest.flatten(inputs)]


# Generators whose first element was read ahead -> that element.
_FIRST = weakref.WeakKeyDictionary()


_HOLDERS = weakref.WeakKeyDictionary()


def _peeked(first, iterator, holder=None):
    def generator():
        yield from iterator

    out = generator()
    _FIRST[out] = first
    _HOLDERS[out] = holder if holder is not None else {}
    return out


def _join(group, num_replicas, capacity):
    if len(group) < num_replicas:
        raise ValueError(
            "`batch='per_replica'` needs the number of batches to be a "
            f"multiple of the replica count ({num_replicas}): the last "
            "group of batches is short. Received: a final group of "
            f"{len(group)} batch(es) from the generator `x`")
    shapes = [[tuple(t.shape)[1:] for t in tf.nest.flatten(g)]
              for g in group]
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError(
            "`batch='per_replica'` joins each group of "
            f"{num_replicas} consecutive batches of the generator `x` into "
            "one global batch, so they must have the same shapes apart "
            f"from the rows. Received: a group of batches of shapes "
            f"{shapes} (rows dropped)")
    sizes = [num_rows(keras.utils.unpack_x_y_sample_weight(g)[0])
             for g in group]
    if tuple(sizes) != split.fill_sizes(sum(sizes), num_replicas, capacity):
        raise ValueError(
            "`batch='per_replica'`: every batch but the last must have the "
            f"same number of rows ({capacity}). Received: batches of "
            f"{sizes} rows from the generator `x`")
    return tf.nest.map_structure(
        lambda *parts: np.concatenate(parts, axis=0), *group)
