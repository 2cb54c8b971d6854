"""What the `"in_graph"` path adds to the step graph per replica.

Counted in the traced graph (`get_concrete_function().graph`), not timed:
the ops a replica adds beyond one device's step, and the tensors each
replica's device sends to the first device. On small models every op and
every cross-device tensor is a measurable share of the step (issue 21,
`docs/performance.md`); these budgets keep the per-replica graph from
growing back. Raise one only with a measurement that says why.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror

# Measured on Keras 3.15.1 / TF 2.21 (the model below, statistics on):
# 204 ops and 11 tensors to the first device per replica before issue 21.
OPS_PER_REPLICA = 199
# Per replica: one gradient per variable, its loss contribution, its
# predictions and one packed row of statistics.
EXTRA_TENSORS_TO_HOME = 3


def _graph(devices, replica_stats):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4)])
    mirrored = keras_mirror.MirroredModel(
        model, devices=devices, execution="in_graph",
        replica_stats=replica_stats)
    mirrored.compile(optimizer="sgd", loss=keras.losses.
                     SparseCategoricalCrossentropy(from_logits=True))
    x = np.zeros((8, 8), "float32")
    mirrored.fit(x, np.zeros((8,), "int32"), batch_size=8, verbose=0)
    specs = (tf.TensorSpec((None, 8)), tf.TensorSpec((None,), tf.int32))
    step = tf.function(mirrored.train_step).get_concrete_function(specs)
    return step.graph, len(model.trainable_weights)


def _to_home(graph, home):
    """`{device: number of its tensors read on `home`}`."""
    counts = {}
    for op in graph.get_operations():
        if not op.device.endswith(home):
            continue
        for tensor in op.inputs:
            source = tensor.op.device
            if source and not source.endswith(home):
                counts[source] = counts.get(source, 0) + 1
    return counts


@pytest.fixture(scope="module")
def graphs():
    devices = keras_mirror.logical_cpus(4)
    one, variables = _graph(devices[:1], True)
    four, _ = _graph(devices, True)
    return one, four, variables


def test_ops_per_replica_within_budget(graphs):
    one, four, _ = graphs
    added = len(four.get_operations()) - len(one.get_operations())
    assert added / 3 <= OPS_PER_REPLICA, added / 3


def test_each_replica_sends_its_statistics_as_one_tensor(graphs):
    _, four, variables = graphs
    counts = _to_home(four, "CPU:0")
    assert sorted(counts) == [f"/device:CPU:{r}" for r in (1, 2, 3)]
    assert set(counts.values()) == {variables + EXTRA_TENSORS_TO_HOME}


def test_stand_in_rows_count_for_nothing_in_the_statistics(cpus):
    """2 rows on 4 replicas: replicas 2 and 3 run a stand-in row each."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus,
                                          execution="in_graph")
    mirrored.compile(optimizer="sgd", loss="mse")
    x = np.arange(6, dtype="float32").reshape(2, 3)
    y = np.ones((2, 2), "float32")
    weights = np.array([0.5, 2.0], "float32")
    mirrored.fit(x, y, sample_weight=weights, batch_size=2, verbose=0)
    logs = mirrored.last_replica_logs
    np.testing.assert_array_equal(logs["samples"], [1, 1, 0, 0])
    np.testing.assert_array_equal(logs["sample_weight"], [0.5, 2.0, 0, 0])
    np.testing.assert_array_equal(logs["loss"][2:], [0, 0])
    np.testing.assert_array_equal(logs["grad_norm"][2:], [0, 0])
    assert mirrored.predict(x, batch_size=2, verbose=0).shape == (2, 2)
