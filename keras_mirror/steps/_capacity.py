"""The batch modes' input adaptation: the split capacity of a step.

In `"global"` mode each input batch is the global batch (capacity None:
the balanced split). In `"per_replica"` mode a step takes `N` replica
batches, grouped here, and each replica holds at most `capacity` rows (the
fill split). A new capacity retraces the step functions.
"""

import keras
import tensorflow as tf

from keras_mirror.wrapper import _inputs


def adapt_input(mirrored, x, batch_size):
    """Returns (x, batch_size) for Keras; sets the split capacity."""
    n = mirrored.num_replicas
    if _inputs.is_generator(x):  # read ahead; per_replica: N per step
        capacity, x = _inputs.adapt_generator(x, n, mirrored.batch_mode)
    elif mirrored.batch_mode == "global":
        capacity = None
    elif isinstance(x, tf.data.Dataset):
        capacity = _inputs.capacity_of(x)
        x = _inputs.group_dataset(x, n)
    elif isinstance(x, keras.utils.PyDataset):
        capacity = _inputs.capacity_of(x)
        x = _inputs.GroupedPyDataset(x, n)
    else:
        capacity = batch_size or 32
        batch_size = capacity * n
    set_capacity(mirrored, capacity)
    return x, batch_size


def set_capacity(mirrored, capacity):
    """Sets the fill-rule capacity; a change retraces the step functions."""
    if capacity != mirrored._capacity:
        mirrored._capacity = capacity
        mirrored.train_function = None
        mirrored.test_function = None
        mirrored.predict_function = None


def on_batch(mirrored, x):
    """One global batch given to `*_on_batch`: `N` replica batches."""
    if mirrored.batch_mode == "per_replica":
        rows = _inputs.num_rows(x)
        set_capacity(mirrored, -(-rows // mirrored.num_replicas))
    else:
        set_capacity(mirrored, None)
