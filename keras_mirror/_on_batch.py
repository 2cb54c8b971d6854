"""`train_on_batch` honours `on_nonfinite` exactly as `fit` does.

In `fit`, `ReplicaHistory` reads each step's `replica_nonfinite` vector and
warns or raises (`ReplicaHistory._report`); the step itself
already skipped the update for `"skip_step"` and `"raise"`. `train_on_batch`
runs no callbacks, so `checked` watches the same vector of its one step and
reports it with the same message.
"""

import numpy as np

from keras_mirror.callbacks import replica_history


def checked(mirrored, run):
    """Runs `run()` (Keras's `train_on_batch`) and reports a non-finite
    step as `fit` would: a warning, or `NonFiniteError` for `"raise"`."""
    mirrored.make_train_function()
    function = mirrored.train_function
    seen = {}

    def watched(data):
        logs = function(data)
        seen.update(logs)
        return logs

    step = int(mirrored.optimizer.iterations.numpy()) + 1
    mirrored.train_function = watched
    try:
        result = run()
    finally:
        mirrored.train_function = function
    bad = seen.get("replica_nonfinite")
    if bad is not None:
        bad = np.asarray(bad, np.float64).reshape(-1)
        if bad.any():
            replica_history.ReplicaHistory(mirrored)._report(bad, step)
    return result
