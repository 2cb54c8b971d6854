"""`batch="per_replica"`: a dataset's or `PyDataset`'s `N` consecutive
batches joined into one global batch.

Each element the input yields is one replica's batch; the joined batch
follows the fill rule (`split.fill_sizes`: full batches, then the
remainder), so that the split gives each replica its own batch back
exactly. A generator's elements are joined in `_inputs.adapt_generator`.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import split


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
