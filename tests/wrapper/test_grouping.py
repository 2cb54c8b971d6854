"""`wrapper._grouping`: a dataset's and a `PyDataset`'s `N` consecutive
batches joined into one global batch (`batch="per_replica"`)."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import data
from support.helpers import max_diff
from support.helpers import mlp

import keras_mirror
from keras_mirror.wrapper import _grouping


def test_a_dataset_joins_consecutive_batches_in_order():
    """Batches of 3 rows, the last of 1: groups of 4 joined in order, the
    last group 3 + 3 + 3 + 1 rows (the fill rule)."""
    rows = np.arange(22, dtype="float32")[:, None]
    batches = tf.data.Dataset.from_tensor_slices(rows).batch(3)
    joined = [t.numpy() for t in _grouping.group_dataset(batches, 4)]
    assert [len(t) for t in joined] == [12, 10]
    np.testing.assert_array_equal(np.concatenate(joined), rows)


def test_a_pydataset_joins_consecutive_items():
    x, y, _ = data(16)
    users = _Reshuffled(x, y)
    grouped = _grouping.GroupedPyDataset(users, 4)
    assert len(grouped) == 2
    gx, gy = grouped[1]
    np.testing.assert_array_equal(gx, x[8:])
    np.testing.assert_array_equal(gy, y[8:])


# -- a per-replica PyDataset keeps the user's workers and epoch hooks ------

class _Reshuffled(keras.utils.PyDataset):
    """Items of 2 rows; `on_epoch_end` reverses their order (a reshuffle
    that the test can follow); records the threads that read."""

    def __init__(self, x, y, rows=2, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.rows = x, y, rows
        self.order = list(range(len(x) // rows))
        self.epoch_ends = 0
        self.threads = set()

    def __len__(self):
        return len(self.order)

    def __getitem__(self, index):
        self.threads.add(threading.current_thread().name)
        rows = slice(self.order[index] * self.rows,
                     (self.order[index] + 1) * self.rows)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epoch_ends += 1
        self.order.reverse()


class _Joined(keras.utils.PyDataset):
    """One device's view of `batch="per_replica"`: item `i` joins items
    `4i ... 4i+3` of `dataset`, whose epoch hooks it calls."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset) // 4

    def __getitem__(self, index):
        items = [self.dataset[4 * index + i] for i in range(4)]
        return tuple(np.concatenate(parts) for parts in zip(*items))

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


@pytest.mark.parametrize("workers", [1, 2])
def test_per_replica_pydataset_keeps_workers_and_reshuffles(cpus, workers):
    """`batch="per_replica"` groups 4 items per step: the user's
    `on_epoch_end` runs as often as on one device (Keras calls it before
    the first epoch too), so each epoch trains on the reshuffled order, and
    `workers` still reads in worker threads. Was: a grouping dataset that
    called neither."""
    x, y, _ = data(32)
    users = _Reshuffled(x, y, workers=workers)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          batch="per_replica")
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(users, epochs=3, verbose=0)
    if workers > 1:  # Keras's reading threads, not only the main thread
        assert users.threads - {"MainThread"}
    reference = mlp()
    reference.compile(optimizer="sgd", loss="mse")
    on_one = _Reshuffled(x, y)
    reference.fit(_Joined(on_one), epochs=3, verbose=0)
    assert users.epoch_ends == on_one.epoch_ends == 4
    assert users.order == on_one.order
    assert max_diff(reference.get_weights(),
                    mirrored.model.get_weights()) < 1e-5
    # Without the reshuffles (epoch 1's order throughout) it would differ.
    unshuffled = mlp()
    unshuffled.compile(optimizer="sgd", loss="mse")
    unshuffled.fit(_Joined(_Ordered(x, y)), epochs=3, verbose=0)
    assert max_diff(unshuffled.get_weights(),
                    mirrored.model.get_weights()) > 1e-4


class _Ordered(_Reshuffled):
    def on_epoch_end(self):
        pass
