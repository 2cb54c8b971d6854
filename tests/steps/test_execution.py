"""The one execution path: every device and model runs the strategy step.

`execution="auto"` and `"strategy"` both run it; the removed `"in_graph"`
is refused naming the replacement.

Also the tests of `keras_mirror/allreduce.py`,
`keras_mirror/steps/_scope.py`, `keras_mirror/steps/dispatch.py`,
`keras_mirror/steps/strategy.py`.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import data
from support.helpers import max_diff
from support.helpers import mlp
from support.helpers import own_step_model

import keras_mirror


def _bn_model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(3),
    ])


def test_auto_runs_the_strategy_path_on_cpus_and_says_why(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    assert mirrored.execution == "strategy"
    assert isinstance(mirrored.strategy, tf.distribute.MirroredStrategy)
    assert mirrored.num_replicas == 4
    assert mirrored.execution_summary == (
        "strategy (tf.distribute MirroredStrategy; one replica step per "
        "device; explicit gradient all-reduce), because it is the one path, "
        "on every device kind: each replica keeps its own copy of the "
        "variables and gradients are all-reduced (NCCL on GPUs).")


def test_auto_on_one_device(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus[2:3])
    assert mirrored.execution == "strategy"
    assert mirrored.num_replicas == 1
    assert mirrored.execution_summary.endswith(
        "because it is the one path; one device runs it as one replica.")


def test_strategy_path_on_request(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          execution="strategy")
    assert isinstance(mirrored.strategy, tf.distribute.MirroredStrategy)
    assert mirrored.execution_summary.startswith(
        "strategy (tf.distribute MirroredStrategy; one replica step per "
        "device; explicit gradient all-reduce)")


def test_unknown_execution_is_refused(cpus):
    with pytest.raises(ValueError) as info:
        keras_mirror.MirroredModel(mlp(), devices=cpus, execution="graph")
    assert str(info.value) == (
        "`execution` must be one of ('auto', 'strategy'). "
        "Received: execution='graph'")


def test_removed_in_graph_is_refused_naming_the_replacement(cpus):
    with pytest.raises(ValueError) as info:
        keras_mirror.MirroredModel(mlp(), devices=cpus, execution="in_graph")
    assert str(info.value) == (
        "`execution='in_graph'` was removed in keras-mirror 0.2: every "
        "device now runs the one `tf.distribute` path, the code GPUs and "
        "clusters run. Omit `execution` (or pass execution='auto' or "
        "'strategy'). Received: execution='in_graph'")


def test_custom_train_step_runs_on_the_strategy_path(cpus):
    def model():
        return own_step_model(6)

    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    assert mirrored.execution == "strategy"


def _fit(model, x, y, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0,
              **kwargs)
    return model


def test_batch_norm_state_is_one_devices(cpus):
    """Moving statistics: every replica normalises by the global batch's
    statistics (`batchnorm="global"`), so the state kept after a step is
    one device's, not replica 0's shard's."""
    x, y, _ = data(14)
    first = _bn_model()
    step = keras_mirror.MirroredModel(_bn_model(), devices=cpus)
    assert step.split_plan(7) == (2, 2, 2, 1)
    step.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    step.train_on_batch(x[:7], y[:7])
    hidden = first.layers[0](x[:7]).numpy()
    bn = step.model.layers[1]
    # One step of momentum 0.5 from (0, 1) on the global batch's 7 rows.
    np.testing.assert_allclose(bn.moving_mean.numpy(),
                               0.5 * hidden.mean(axis=0), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(),
                               0.5 + 0.5 * hidden.var(axis=0), rtol=1e-4,
                               atol=1e-6)


class ReplicaIds(keras.layers.Layer):
    """Adds 10 * replica id to its input (a visible per-replica value)."""

    def call(self, x):
        ctx = keras_mirror.replica_context()
        return x + 10.0 * tf.cast(ctx.replica_id, x.dtype)


@pytest.mark.parametrize("execution", ["strategy"])
def test_replica_context_in_the_builtin_forward_pass(cpus, execution):
    inputs = keras.Input((1,))
    model = keras.Model(inputs, ReplicaIds()(inputs))
    mirrored = keras_mirror.MirroredModel(model, devices=cpus,
                                          execution=execution)
    out = mirrored.predict(np.zeros((6, 1), "float32"), batch_size=6,
                           verbose=0)
    # split_plan(6) == (2, 2, 1, 1): rows carry their replica's id.
    np.testing.assert_array_equal(out[:, 0], [0, 0, 10, 10, 20, 30])


class Reduces(keras.layers.Layer):
    def call(self, x):
        return x + keras_mirror.replica_context().all_reduce_sum(
            tf.reduce_sum(x))


def test_reductions_in_a_layer_run_in_the_forward_pass(cpus):
    inputs = keras.Input((1,))
    model = keras.Model(inputs, Reduces()(inputs))
    strategy = keras_mirror.MirroredModel(model, devices=cpus,
                                          execution="strategy")
    out = strategy.predict(np.ones((4, 1), "float32"), batch_size=4,
                           verbose=0)
    np.testing.assert_array_equal(out[:, 0], [5.0, 5.0, 5.0, 5.0])


@pytest.mark.parametrize("execution", ["strategy"])
def test_replica_step_time_is_measured_from_one_clock_reading(cpus,
                                                               execution):
    """`replica_step_time` runs from one reading at the step's start, and
    TF reads the replicas' end clocks in replica order (README)."""
    import time

    x, y, _ = data(40)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          execution=execution)
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(x, y, batch_size=8, epochs=1, verbose=0)  # traced
    begin = time.perf_counter()
    mirrored.fit(x, y, batch_size=8, epochs=1, verbose=0)
    wall = time.perf_counter() - begin
    times = np.array([step["step_time"]
                      for step in mirrored.replica_history["batch"][-5:]])
    assert times.shape == (5, 4)
    assert np.all(times > 0)
    assert np.all(np.diff(times, axis=1) >= 0)
    assert times.sum(axis=0).max() < wall


@pytest.mark.parametrize("gradient_dtype", ["bfloat16", "float16"])
def test_reduced_precision_sum_rounds_the_wire_only(cpus, gradient_dtype):
    x, y, _ = data(21)
    mirrored = _fit(keras_mirror.MirroredModel(
        mlp(), devices=cpus, gradient_dtype=gradient_dtype), x, y)
    reference = _fit(mlp(), x, y)
    full = _fit(keras_mirror.MirroredModel(mlp(), devices=cpus), x, y)
    # The gradients travel rounded to 8 (bf16) or 11 (fp16) bits...
    got = mirrored.model.get_weights()
    assert max_diff(got, reference.get_weights()) > 1e-7
    assert max_diff(full.model.get_weights(), reference.get_weights()) < 1e-5
    # ...and only the wire is rounded: the result stays close.
    assert max_diff(got, reference.get_weights()) < 5e-2
    assert mirrored.allreduce_bytes_per_step == 2 * reference.count_params()


@pytest.mark.parametrize("execution", ["strategy"])
def test_batch_norm_with_empty_shards_stays_finite(cpus, execution):
    """B < N leaves replicas without rows; BatchNormalization's mean over
    no rows is NaN, and `0 * NaN` in its backward pass used to reach the
    all-reduced gradient. Empty shards now contribute exact zeros."""
    x, y, _ = data(9)
    mirrored = keras_mirror.MirroredModel(_bn_model(), devices=cpus,
                                          execution=execution)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert mirrored.split_plan(2) == (1, 1, 0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no non-finite warning either
        mirrored.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    weights = mirrored.model.get_weights()
    assert all(np.isfinite(w).all() for w in weights)
    assert np.sum(mirrored.replica_history["nonfinite"]) == 0
    assert np.isfinite(mirrored.predict(x, batch_size=3, verbose=0)).all()
    # The same state on every replica, so predictions don't depend on
    # which replica a row lands on.
    np.testing.assert_allclose(
        mirrored.predict(x, batch_size=3, verbose=0),
        mirrored.model.predict(x, batch_size=3, verbose=0), atol=1e-5)


def test_buckets_group_gradients_by_bytes():
    from keras_mirror import allreduce

    assert allreduce.buckets([384, 64, 192, 12], 0) == [[0, 1, 2, 3]]
    assert allreduce.buckets([384, 64, 192, 12], 256) == [[0], [1, 2], [3]]
    assert allreduce.buckets([10, 10, 10], 1 << 20) == [[0, 1, 2]]
    assert allreduce.buckets([], 256) == []


def test_reverse_buckets_start_from_the_last_gradients():
    from keras_mirror import allreduce

    assert allreduce.reverse_buckets([384, 64, 192, 12], 0) == [[0, 1, 2, 3]]
    assert allreduce.reverse_buckets([384, 64, 192, 12], 256) == [
        [3, 2, 1], [0]]
    assert allreduce.reverse_buckets([10, 300, 10], 256) == [[2, 1], [0]]
    assert allreduce.reverse_buckets([], 256) == []


def test_bytes_per_pack_buckets_the_all_reduce_and_stays_exact(
        cpus, monkeypatch):
    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(len(tf.nest.flatten(value)))
        return original(self, reduce_op, value, options=options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce",
                        counting)
    x, y, _ = data(30)
    reference = _fit(mlp(), x, y)
    traced = {}
    for pack in (0, 256):
        calls.clear()
        mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                              bytes_per_pack=pack,
                                              execution="strategy")
        _fit(mirrored, x, y)
        traced[pack] = list(calls)
        assert max_diff(reference.get_weights(),
                        mirrored.model.get_weights()) < 1e-5
    # mlp(): gradients of 384, 64, 192 and 12 bytes. Each of the 4
    # replicas traces one 4-tensor all-reduce without packing, and the
    # buckets [3, 2, 1], [0] with 256-byte packs (last gradients first, so
    # that they overlap with backprop); then the loss, in both
    # runs (the non-finite count is all-reduced only when `on_nonfinite`
    # acts on it, not in the default "warn" mode).
    assert traced[0] == [4] * 4 + [1] * 4
    assert traced[256] == [3] * 4 + [1] * 4 + [1] * 4
