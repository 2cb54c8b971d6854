"""What holds while the replicas' steps are traced, on every path."""

import contextlib

from keras_mirror import _compat
from keras_mirror.steps import _metric_weights
from keras_mirror.steps import _random
from keras_mirror.steps import _stand_in


@contextlib.contextmanager
def replica_scope(mirrored):
    """One device's losses, random draws and metric weights, per replica.

    - Keras does not divide losses by the replica count
      (`_compat.unscaled_losses`): each replica computes its shard's own
      loss and keras-mirror weights it;
    - `keras.random` draws give one device's numbers (`_random`);
    - mean metrics updated inside a replica weigh it as one device would
      (`_metric_weights`), an output's loss that is a batch sum as a sum;
    - an empty shard's stand-in row updates no metric and stays out of
      synchronized BatchNorm's statistics (`_stand_in`).
    """
    reductions = getattr(mirrored, "_reductions", None)
    sums = reductions.sum_trackers(mirrored._inner) if reductions else ()
    with _compat.unscaled_losses(), _random.exact_draws(), \
            _metric_weights.replica_weights(mirrored._inner, sums), \
            _stand_in.exclude_from_moments():
        yield
