"""`train_on_batch` and `test_on_batch` return what plain Keras returns.

The steps return per-replica `replica_*` vectors beside Keras's keys; plain
Keras's `*_on_batch` would hand them back to the caller (8 values where the
user unpacks `loss, mae`). `plain` runs Keras's `*_on_batch` with a step
function that keeps the vectors aside (`mirrored.last_replica_logs`, and the
non-finite check below) and gives Keras only its own keys, so the result is a
scalar, a list in Keras's order, or a dict with `return_dict=True`, exactly
as for the unwrapped model.

`train_on_batch` also honours `on_nonfinite` exactly as `fit` does: in
`fit`, `ReplicaHistory` reads each step's `replica_nonfinite` vector and
warns or raises (`ReplicaHistory._report`); the step itself already skipped
the update for `"skip_step"` and `"raise"`. `train_on_batch` runs no
callbacks, so `checked` watches the same vector of its one step and reports
it with the same message.
"""

import numpy as np

from keras_mirror.callbacks import replica_history
from keras_mirror.steps import _replica_stats
from keras_mirror.wrapper import _compile


def plain(mirrored, kind, run):
    """Runs `run()` (Keras's `<kind>_on_batch`) on plain Keras's keys.

    `kind` is `"train"` or `"test"`. Returns `(result, the step's logs with
    the per-replica vectors)`.
    """
    attribute = f"{kind}_function"
    getattr(mirrored, f"make_{attribute}")()
    function = getattr(mirrored, attribute)
    seen = {}

    def stripped(data):
        logs = function(data)
        seen.update(logs)
        if kind == "test":  # a model's own `test_step` has vectors too
            _replica_stats.remember(mirrored, logs)
        return _replica_stats.strip(logs)

    setattr(mirrored, attribute, stripped)
    try:
        result = run()
    finally:
        setattr(mirrored, attribute, function)
    return result, seen


def checked(mirrored, run):
    """Runs `run()` (Keras's `train_on_batch`) and reports a non-finite
    step as `fit` would: a warning, or `NonFiniteError` for `"raise"`."""
    _compile.warn_nothing_to_train(mirrored)
    step = int(mirrored.optimizer.iterations.numpy()) + 1
    result, seen = plain(mirrored, "train", run)
    bad = seen.get("replica_nonfinite")
    if bad is not None:
        bad = np.asarray(bad, np.float64).reshape(-1)
        if bad.any():
            replica_history.ReplicaHistory(mirrored)._report(bad, step)
    return result
