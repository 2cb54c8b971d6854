"""The batch modes' split capacity of a step.

In `"global"` mode each input batch is the global batch (capacity None:
the balanced split). In `"per_replica"` mode a step takes `N` replica
batches (grouped by `wrapper/_fit_input.adapt`), and each replica holds at
most `capacity` rows (the fill split). A new capacity retraces the step
functions.
"""

import tensorflow as tf


def set_capacity(mirrored, capacity):
    """Sets the fill-rule capacity; a change retraces the step functions."""
    if capacity != mirrored._step_state.capacity:
        mirrored._step_state.capacity = capacity
        mirrored.train_function = None
        mirrored.test_function = None
        mirrored.predict_function = None


def on_batch(mirrored, x):
    """One global batch given to `*_on_batch`: `N` replica batches."""
    if mirrored.batch_mode == "per_replica":
        rows = int(next(t for t in tf.nest.flatten(x)
                        if t is not None).shape[0])
        n = mirrored._strategy.num_replicas_in_sync
        set_capacity(mirrored, -(-rows // n))
    else:
        set_capacity(mirrored, None)
