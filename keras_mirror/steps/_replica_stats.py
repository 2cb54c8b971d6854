"""The per-replica statistics a step returns, packed and unpacked.

`train_step` returns, beside the usual global keys, vectors of length
`num_replicas` under the keys `replica_*` (and `val_replica_*` after
validation). The built-in step packs its statistics into one matrix
(`PACKED`); `unpacking` splits it back before Keras or any callback sees
the logs; `strip` takes the vectors out for the callbacks that did not
ask for them (`callbacks/_replica_logs`).
"""

import functools

import numpy as np

PREFIX = "replica_"
# Keras prefixes validation logs with `val_`.
_PREFIXES = (PREFIX, "val_" + PREFIX)
# The built-in train step's per-replica statistics, in this order.
STAT_KEYS = (
    "replica_loss",
    "replica_samples",
    "replica_sample_weight",
    "replica_grad_norm",
    "replica_nonfinite",
    "replica_step_time",
)
# The train step returns them as one float32 matrix under this key, one row
# per replica and one column per `STAT_KEYS` entry: one output tensor and one
# device-to-host copy per step instead of six, which measured ~5% of a 2 ms
# step (`benchmarks/README.md`). `unpacking` splits it back into the
# `replica_*` vectors before Keras or any callback sees the logs.
PACKED = "_replica_stats"


def strip(logs):
    """`logs` without the per-replica vectors."""
    if not logs:
        return logs
    return {k: v for k, v in logs.items() if not k.startswith(_PREFIXES)}


def unpack(logs, keys=STAT_KEYS):
    """`logs` with the packed statistics split into `replica_*` vectors.

    `keys` name the packed matrix's columns (`MirroredModel(replica_stats=
    False)` packs fewer).
    """
    if not isinstance(logs, dict) or PACKED not in logs:
        return logs
    logs = dict(logs)
    columns = np.ascontiguousarray(np.asarray(logs.pop(PACKED)).T)
    if len(columns) != len(keys):
        raise ValueError(
            f"The packed per-replica statistics have {len(columns)} "
            f"columns; expected one per key of {keys}.")
    for key, column in zip(keys, columns):
        logs[key] = column
    return logs


def unpacking(function, keys=STAT_KEYS, owner=None):
    """Wraps a Keras train function so that its logs come unpacked.

    With `owner` (the `MirroredModel`), each step's `replica_*` vectors
    are also kept for `owner.last_replica_logs` (`remember`).
    """
    if function is None or getattr(function, "_unpacks_replica_stats",
                                   False):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        logs = unpack(function(*args, **kwargs), keys)
        if owner is not None:
            remember(owner, logs)
        return logs

    call._unpacks_replica_stats = True
    return call


def remember(owner, logs):
    """Keeps the step's `replica_*` vectors (tensors; read when asked)."""
    if isinstance(logs, dict):
        vectors = {k: v for k, v in logs.items() if k.startswith(PREFIX)}
        owner._step_state.last_replica_logs = vectors


def last_logs(owner):
    """`{name: NumPy vector}` of the last step's `replica_<name>` values."""
    vectors = owner._step_state.last_replica_logs or {}
    return {k[len(PREFIX):]: np.asarray(v).reshape(-1)
            for k, v in vectors.items()}
