"""Every example is seen exactly once per epoch, by the replica the plan says.

Input column 0 carries each example's id. A `Recorder` layer inside the model
hands `(replica id, ids of its shard)` to Python through `tf.py_function`
(a stateful op, so the traced step always runs it, also for empty shards);
a callback closes each step's records at `on_train_batch_end`. The test then
checks, for `batch="global"` and `batch="per_replica"`, with shuffling and
with final batches that don't divide (one of them smaller than the replica
count), that the ids form a partition of the data set and that each step's
shard sizes equal `mirrored.split_plan`.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror

# Each test runs on both execution paths (conftest.py).
pytestmark = pytest.mark.usefixtures("execution")

NUM_REPLICAS = 4
FEATURES = 3


class Log:
    """Per-step records `{replica: [ids]}` of the running fit."""

    def __init__(self):
        self.current = collections.defaultdict(list)
        self.steps = []

    def record(self, replica, ids):
        self.current[int(replica.numpy())].append(ids.numpy().tolist())
        return np.int32(0)

    def close_step(self):
        self.steps.append(dict(self.current))
        self.current = collections.defaultdict(list)


LOG = Log()


class Recorder(keras.layers.Layer):
    """Identity layer that records the ids (column 0) each replica sees."""

    def call(self, x, training=None):
        if training:
            ctx = keras_mirror.replica_context()
            # The shard's rows: an empty shard runs one stand-in row,
            # which is not data (`replica_context().shard_size` is 0).
            ids = tf.cast(tf.round(x[:ctx.shard_size, 0]), tf.int64)
            tf.py_function(LOG.record, [ctx.replica_id, ids],
                           tf.int32)
        return x


class StepCloser(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        LOG.close_step()


def _mirrored(cpus, batch):
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1)(Recorder()(inputs))
    model = keras.Model(inputs, outputs)
    mirrored = keras_mirror.MirroredModel(model, devices=cpus, batch=batch)
    mirrored.compile(optimizer="sgd", loss="mse")
    return mirrored


def _data(n):
    x = np.random.rand(n, FEATURES).astype("float32")
    x[:, 0] = np.arange(n)
    y = np.random.rand(n, 1).astype("float32")
    return x, y


def _fit(mirrored, x, y=None, **kwargs):
    LOG.steps.clear()
    LOG.current.clear()
    mirrored.fit(x, y, verbose=0, callbacks=[StepCloser()], **kwargs)
    assert not LOG.current, "records outside a step"
    return LOG.steps


def _check_partition(steps, num_examples, num_replicas):
    everything = [i for step in steps for calls in step.values()
                  for ids in calls for i in ids]
    assert sorted(everything) == list(range(num_examples))
    for step in steps:
        # Each replica runs its step exactly once per step.
        assert sorted(step) == list(range(num_replicas))
        assert all(len(calls) == 1 for calls in step.values())


def _sizes(step, num_replicas):
    return tuple(len(step[r][0]) for r in range(num_replicas))


@pytest.mark.parametrize("num_examples,batch_size", [
    (23, 10),   # last batch of 3 < 4 replicas
    (30, 8),    # last batch of 6 does not divide by 4
    (2, 5),     # one batch, smaller than the replica count
])
def test_global_batches_partition_arrays(cpus, num_examples, batch_size):
    mirrored = _mirrored(cpus, "global")
    x, y = _data(num_examples)
    steps = _fit(mirrored, x, y, batch_size=batch_size, shuffle=True)
    _check_partition(steps, num_examples, NUM_REPLICAS)
    rows = [min(batch_size, num_examples - i)
            for i in range(0, num_examples, batch_size)]
    assert len(steps) == len(rows)
    for step, b in zip(steps, rows):
        assert _sizes(step, NUM_REPLICAS) == mirrored.split_plan(b)
    # The engine's own per-replica counts agree with what the layer saw.
    samples = [s["samples"] for s in mirrored.replica_history["batch"]]
    assert [tuple(int(v) for v in s) for s in samples] == [
        _sizes(step, NUM_REPLICAS) for step in steps]


def test_global_batches_partition_shuffled_dataset_two_epochs(cpus):
    mirrored = _mirrored(cpus, "global")
    x, y = _data(37)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        64, reshuffle_each_iteration=True).batch(9)
    steps = _fit(mirrored, ds, epochs=2)
    per_epoch = len(steps) // 2
    seen_orders = []
    for epoch in (steps[:per_epoch], steps[per_epoch:]):
        _check_partition(epoch, 37, NUM_REPLICAS)
        for step in epoch:
            b = sum(_sizes(step, NUM_REPLICAS))
            assert _sizes(step, NUM_REPLICAS) == mirrored.split_plan(b)
        seen_orders.append([step[0][0] for step in epoch])
    assert seen_orders[0] != seen_orders[1]  # shuffled each epoch


def test_per_replica_batches_partition_shuffled_dataset(cpus):
    mirrored = _mirrored(cpus, "per_replica")
    x, y = _data(23)  # 8 batches of 3 (last of 2): two groups of 4
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64).batch(3)
    steps = _fit(mirrored, ds)
    _check_partition(steps, 23, NUM_REPLICAS)
    assert [_sizes(s, NUM_REPLICAS) for s in steps] == [
        (3, 3, 3, 3), (3, 3, 3, 2)]
    for step in steps:
        b = sum(_sizes(step, NUM_REPLICAS))
        assert _sizes(step, NUM_REPLICAS) == mirrored.split_plan(
            b, replica_batch_size=3)


def test_per_replica_batches_partition_arrays(cpus):
    mirrored = _mirrored(cpus, "per_replica")
    x, y = _data(13)  # replica batch 2: global 8, then 5 -> 2, 2, 1, 0
    steps = _fit(mirrored, x, y, batch_size=2, shuffle=True)
    _check_partition(steps, 13, NUM_REPLICAS)
    assert [_sizes(s, NUM_REPLICAS) for s in steps] == [
        (2, 2, 2, 2), (2, 2, 1, 0)]
    for step in steps:
        b = sum(_sizes(step, NUM_REPLICAS))
        assert _sizes(step, NUM_REPLICAS) == mirrored.split_plan(
            b, replica_batch_size=2)


def test_two_replicas_see_everything_once(cpus):
    mirrored = _mirrored(cpus[:2], "global")
    x, y = _data(11)
    steps = _fit(mirrored, x, y, batch_size=4, shuffle=True)
    _check_partition(steps, 11, 2)
    assert [_sizes(s, 2) for s in steps] == [(2, 2), (2, 2), (2, 1)]
