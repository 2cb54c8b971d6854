"""Property-based tests: each replica gets its rows and one step is exact.

The split rules' own properties are in `tests/test_split.py`. These draw
the replica count (1..4, `devices=cpus[:n]`), the batch size (also `0 < B <
N`), sample weights and, for `batch="per_replica"`, the shard
layout; they reuse one compiled `MirroredModel` per replica count and keep
the example count small. Each checks that the rows the replicas really
receive (recorded inside the model by id) are the `split_plan` partition of
the batch, and that the step's weights equal single-device training on the
same global batch within 1e-5.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_mirror

# Each test runs on both execution paths (conftest.py).
pytestmark = pytest.mark.usefixtures("execution")

FEATURES = 3
REAL = settings(max_examples=15, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


# -- real shards -----------------------------------------------------------

SEEN = collections.defaultdict(list)


def _record(replica, ids):
    SEEN[int(replica.numpy())].append(ids.numpy().tolist())
    return np.int32(0)


class Recorder(keras.layers.Layer):
    """Identity; records the ids (column 0) each replica trains on."""

    def call(self, x, training=None):
        if training:
            ctx = keras_mirror.replica_context()
            # The shard's rows: an empty shard runs one stand-in row,
            # which is not data (`replica_context().shard_size` is 0).
            ids = tf.cast(tf.round(x[:ctx.shard_size, 0]), tf.int64)
            tf.py_function(_record, [ctx.replica_id, ids],
                           tf.int32)
        return x


def _model():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(4, activation="tanh")(Recorder()(inputs))
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


class Models:
    """One compiled MirroredModel per replica count, and a reference."""

    def __init__(self, cpus, batch):
        keras.utils.set_random_seed(3)
        self.reference = _model()
        self.initial = self.reference.get_weights()
        self.reference.compile(optimizer=keras.optimizers.SGD(0.1),
                               loss="mse")
        self._cpus = cpus
        self._batch = batch
        self._mirrored = {}

    def mirrored(self, n):
        if n not in self._mirrored:
            m = keras_mirror.MirroredModel(
                _model(), devices=self._cpus[:n], batch=self._batch)
            m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            self._mirrored[n] = m
        m = self._mirrored[n]
        for v, w in zip(m._inner.weights, self.initial):
            v.assign(w)
        return m

    def reference_step(self, x, y, sw):
        self.reference.set_weights(self.initial)
        self.reference.train_on_batch(x, y, sample_weight=sw)
        return self.reference.get_weights()


def _batch(rows, weighted, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    x[:, 0] = np.arange(rows)
    y = rng.normal(size=(rows, 2)).astype("float32")
    sw = rng.uniform(0.0, 2.0, rows).astype("float32") if weighted else None
    return x, y, sw


def _recorded_sizes(n):
    assert sorted(SEEN) == list(range(n))
    assert all(len(calls) == 1 for calls in SEEN.values())
    ids = [i for r in range(n) for i in SEEN[r][0]]
    return tuple(len(SEEN[r][0]) for r in range(n)), ids


def _assert_close(mirrored, expected):
    for a, b in zip(mirrored.model.get_weights(), expected):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@REAL
@given(n=st.integers(1, 4), rows=st.integers(1, 13), weighted=st.booleans(),
       seed=st.integers(0, 2**16))
def test_global_step_partitions_and_is_exact(cpus, n, rows, weighted, seed):
    models = test_global_step_partitions_and_is_exact.models
    if models is None:
        models = Models(cpus, "global")
        test_global_step_partitions_and_is_exact.models = models
    mirrored = models.mirrored(n)
    x, y, sw = _batch(rows, weighted, seed)
    SEEN.clear()
    mirrored.train_on_batch(x, y, sample_weight=sw)
    sizes, ids = _recorded_sizes(n)
    assert sizes == mirrored.split_plan(rows)
    assert ids == list(range(rows))  # contiguous, in replica order
    _assert_close(mirrored, models.reference_step(x, y, sw))


test_global_step_partitions_and_is_exact.models = None


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(n=st.integers(1, 4), capacity=st.integers(1, 3), data=st.data())
def test_per_replica_layout_partitions_and_is_exact(cpus, n, capacity, data):
    """`n` user batches of `capacity` rows, the last one possibly short."""
    holder = test_per_replica_layout_partitions_and_is_exact
    if holder.models is None:
        holder.models = Models(cpus, "per_replica")
    models = holder.models
    last = data.draw(st.integers(1, capacity), label="last")
    weighted = data.draw(st.booleans(), label="weighted")
    rows = capacity * (n - 1) + last
    x, y, sw = _batch(rows, weighted, seed=rows)
    parts = (x, y) if sw is None else (x, y, sw)
    ds = tf.data.Dataset.from_tensor_slices(parts).batch(capacity)
    mirrored = models.mirrored(n)
    SEEN.clear()
    mirrored.fit(ds, epochs=1, verbose=0)
    sizes, ids = _recorded_sizes(n)
    assert sizes == mirrored.split_plan(rows, replica_batch_size=capacity)
    assert sizes == (capacity,) * (n - 1) + (last,)
    assert ids == list(range(rows))
    _assert_close(mirrored, models.reference_step(x, y, sw))


test_per_replica_layout_partitions_and_is_exact.models = None
