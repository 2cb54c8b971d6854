"""The batch mode: `batch="per_replica"` joins `N` batches into one.

The third stage of the pass over the input (`_fit_input`), after the
checks: in `"per_replica"` mode each element the input yields is one
replica's batch, and `N` consecutive elements (of a dataset, a
`PyDataset` or a generator) are joined here into one global batch that
follows the fill rule (`split.fill_sizes`: full batches, then the
remainder), so that the split gives each replica its own batch back
exactly; the split capacity is set (`steps/_capacity`). A generator is
peeked in either mode (its first element, through the pass's `First`,
leads the generator returned), and every batch it yields is checked
against the first's structure and the model's input shapes.
"""

import itertools

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import split
from keras_mirror.steps import _capacity
from keras_mirror.wrapper import _rebuild


def _rows(x):
    return int(next(t for t in tf.nest.flatten(x)
                    if t is not None).shape[0])


def adapt_fit(mirrored, x, batch_size, validation_data, first,
              validation_first):
    """`fit`'s (x, batch_size, validation_data) in the batch mode."""
    x, batch_size = adapt(mirrored, x, batch_size, first)
    return x, batch_size, _validation(mirrored, validation_data,
                                      validation_first)


def _group_check(lengths, num_replicas):
    capacity = lengths[0]
    expected = split.sizes_tensor(tf.reduce_sum(lengths), num_replicas,
                                  capacity)
    n = tf.shape(lengths)[0]
    tf.debugging.assert_equal(
        n, num_replicas,
        message=(
            f"`batch='per_replica'` needs the number of batches to be a "
            f"multiple of the replica count ({num_replicas}): the last "
            "group of batches is short. Received: a final group of fewer "
            f"than {num_replicas} batches"),
    )
    tf.debugging.assert_equal(
        lengths, expected,
        message=(
            "`batch='per_replica'`: every batch but the last must have the "
            "same number of rows. Received: batches of uneven sizes"),
    )


def group_dataset(dataset, num_replicas):
    """Concatenates `num_replicas` consecutive elements of `dataset`."""
    ragged = dataset.ragged_batch(num_replicas)

    def concat(*element):
        element = element if len(element) > 1 else element[0]
        leaves = [t for t in tf.nest.flatten(element) if t is not None]
        _group_check(_lengths(leaves[0]), num_replicas)
        return tf.nest.map_structure(_joined, element)

    return ragged.map(concat)


def _lengths(t):
    """Rows of each of the batches `ragged_batch` stacked into `t`."""
    if isinstance(t, tf.RaggedTensor):
        return tf.cast(t.row_lengths(), tf.int32)
    # Batches of one static size (`drop_remainder=True`) stack densely.
    return tf.fill(tf.shape(t)[:1], tf.shape(t)[1])


def _joined(t):
    if isinstance(t, tf.RaggedTensor):
        return t.values
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))


class GroupedPyDataset(keras.utils.PyDataset):
    """A `PyDataset` whose item `i` joins items `N*i ... N*i+N-1`.

    It reads with the user's `workers`, `use_multiprocessing` and
    `max_queue_size`, and passes `on_epoch_begin` and `on_epoch_end` on to
    the user's dataset (a reshuffle at the end of each epoch), as Keras does
    with the user's dataset on one device.
    """

    def __init__(self, dataset, num_replicas, first=None):
        super().__init__(workers=dataset.workers,
                         use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self._dataset = dataset
        self._n = num_replicas
        # Item 0 as read before the first step (`First`): handed to the
        # first read of item 0 instead of reading it again.
        self._held = first if first is not None and first.was_read else None
        if len(dataset) % num_replicas:
            raise ValueError(
                "`batch='per_replica'` needs the number of batches to be a "
                f"multiple of the replica count ({num_replicas}). "
                f"Received: a PyDataset with {len(dataset)} batches")

    def __len__(self):
        return len(self._dataset) // self._n

    def __getitem__(self, index):
        items = [self._item(index * self._n + i) for i in range(self._n)]
        return tf.nest.map_structure(
            lambda *parts: np.concatenate(parts, axis=0), *items)

    def on_epoch_begin(self):
        self._dataset.on_epoch_begin()

    def on_epoch_end(self):
        # Keras calls it before the first epoch too. The item read ahead
        # may be stale once the user's own `on_epoch_end` ran (a
        # reshuffle), and a worker process that handed it out did not clear
        # it here: it is read again then.
        if type(self._dataset).on_epoch_end is not \
                keras.utils.PyDataset.on_epoch_end:
            self._held = None
        self._dataset.on_epoch_end()

    def _item(self, index):
        if index == 0 and self._held is not None:
            held, self._held = self._held, None
            return held.read()
        return self._dataset[index]


def _validation(mirrored, validation_data, first):
    """`validation_data` adapted to the batch mode (`first`: its `First`)."""
    if not isinstance(validation_data,
                      (tf.data.Dataset, keras.utils.PyDataset)):
        return validation_data
    capacity = mirrored._step_state.capacity
    validation_data, _ = adapt(mirrored, validation_data, None, first)
    if mirrored._step_state.capacity != capacity:
        # One capacity splits the training and the validation steps: a
        # smaller one would drop training rows, a larger validation rows.
        raise ValueError(
            "`validation_data` must have the per-replica batch size of `x` "
            f"({capacity} rows) with `batch='per_replica'`: the training "
            "and validation steps split by one capacity, and another would "
            "drop rows. Received: validation_data with batches of "
            f"{mirrored._step_state.capacity} rows")
    return validation_data


def adapt(mirrored, x, batch_size, first):
    """(x, batch_size) for Keras in the batch mode; sets the capacity.

    `first` is the pass's `First` of `x`. A generator comes back as one
    that yields its peeked first element first; in `"per_replica"` mode
    a dataset, `PyDataset` or generator
    comes back joining `N` consecutive batches, and arrays' `batch_size`
    is multiplied by `N`.
    """
    n = mirrored.num_replicas
    if first.kind == "generator":
        shapes = _rebuild.expected_inputs(mirrored._inner)
        capacity, x = _adapt_generator(
            x, n, mirrored.batch_mode, first, None if shapes is None else
            [tuple(t.shape) for t in tf.nest.flatten(shapes)])
    elif mirrored.batch_mode == "global":
        capacity = None
    elif isinstance(x, tf.data.Dataset):
        capacity = capacity_of(x, first)
        x = group_dataset(x, n)
    elif isinstance(x, keras.utils.PyDataset):
        capacity = capacity_of(x, first)
        x = GroupedPyDataset(x, n, first)
    else:
        capacity = batch_size or 32
        batch_size = capacity * n
    _capacity.set_capacity(mirrored, capacity)
    return x, batch_size


def capacity_of(dataset, first):
    """Rows in the first element of a per-replica dataset or `PyDataset`.

    Read from the element spec when the batch size is static; otherwise
    from the first element (`first`, the pass's `First` of `dataset`).
    """
    if isinstance(dataset, tf.data.Dataset):
        spec = keras.utils.unpack_x_y_sample_weight(dataset.element_spec)[0]
        rows = next(s for s in tf.nest.flatten(spec)
                    if s is not None).shape[:1].as_list()
        if rows and rows[0] is not None:  # batched with drop_remainder=True
            return rows[0]
    x = keras.utils.unpack_x_y_sample_weight(first.read())[0]
    return int(tf.shape(next(t for t in tf.nest.flatten(x)
                             if t is not None))[0])


def _adapt_generator(generator, num_replicas, batch_mode, first,
                     input_shapes):
    """(capacity, a generator) for `MirroredModel`'s input.

    Its first element is read ahead (`first`, the pass's `First`),
    so that the model can be built from it before the first step; the
    returned generator yields it first. In `"per_replica"` mode it joins
    `num_replicas` consecutive elements into one global batch; the
    capacity is the first element's rows, and each group must follow the
    fill rule (full batches, then the remainder), as `group_dataset`'s.
    Every batch must fit `input_shapes` (a built model's, else None).
    """
    first = first.read()
    items = _same_shapes(first, itertools.chain([first], generator),
                         input_shapes)
    if batch_mode == "global":
        return None, _peeked(items)
    capacity = _rows(keras.utils.unpack_x_y_sample_weight(first)[0])

    def joined():
        while True:
            group = list(itertools.islice(items, num_replicas))
            if not group:
                return
            yield _join(group, num_replicas, capacity)

    return capacity, _peeked(joined())


def _ranks(element):
    """(structure, each leaf's rank) of one batch."""
    return (tf.nest.map_structure(lambda _: 0, element),
            [len(getattr(t, "shape", ())) for t in tf.nest.flatten(element)])


def _same_shapes(first, items, input_shapes):
    """`items`, refusing an element whose structure or ranks differ from
    the first's, or whose inputs do not fit the model's input shapes
    (`input_shapes`): a traced step would fail on it with an error that
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
        for leaf, shape in zip(inputs, input_shapes or ()):
            if leaf is not None and not _rebuild.fits(leaf.shape, shape):
                raise ValueError(
                    f"Every batch of the generator `x` must have the shape "
                    f"{shape} (None: any size) of the model's input: batch "
                    f"{index} differs. Received: x.shape="
                    f"{tuple(leaf.shape)} in batch {index}")
        yield element


def _peeked(iterator):
    def generator():
        yield from iterator

    return generator()


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
    sizes = [_rows(keras.utils.unpack_x_y_sample_weight(g)[0])
             for g in group]
    if tuple(sizes) != split.fill_sizes(sum(sizes), num_replicas, capacity):
        raise ValueError(
            "`batch='per_replica'`: every batch but the last must have the "
            f"same number of rows ({capacity}). Received: batches of "
            f"{sizes} rows from the generator `x`")
    return tf.nest.map_structure(
        lambda *parts: np.concatenate(parts, axis=0), *group)
