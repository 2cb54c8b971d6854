"""`replica_context().all_gather(t)`: the global batch's rows, differentiable.

On the `"strategy"` path every replica gets every replica's rows in replica
order, and the gradient goes back to each replica's own rows, so a loss
that depends on the whole batch (in-batch negatives) trains as on one
device: `examples/contrastive.py` within 1e-5, for uneven and empty shards,
in a model's own `train_step` and in a layer under the built-in step.
"""

import importlib.util

import keras
import numpy as np
import pytest
import tensorflow as tf
from support import helpers
from support.helpers import max_diff

import keras_mirror

TOL = 1e-5
_EXAMPLE = (helpers.EXAMPLES
            / "contrastive.py")


def _example():
    spec = importlib.util.spec_from_file_location("contrastive", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rows", [60, 59])  # 59: the last shard is empty
def test_contrastive_example_is_exact_with_all_gather(cpus, rows):
    example = _example()
    args = example.parse_args(["--rows", str(rows), "--epochs", "2"])
    single, h1 = example.train(args, None, True)
    gathered, h2 = example.train(args, cpus, True)
    assert max_diff(single.get_weights(), gathered.get_weights()) < TOL
    np.testing.assert_allclose(h2.history["loss"], h1.history["loss"],
                               rtol=1e-5)


def test_shard_local_negatives_differ_from_one_device(cpus):
    example = _example()
    args = example.parse_args(["--epochs", "2"])
    single, _ = example.train(args, None, True)
    with pytest.warns(UserWarning, match=r"computes `MatMul` of shape "
                      r"\(b, b\), where b is the rows of one replica's"):
        local, _ = example.train(args, cpus, False)
    assert max_diff(single.get_weights(), local.get_weights()) > 1e-2


class _GatherProbe(keras.Model):
    """Returns what `all_gather` gave this replica."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        ctx = keras_mirror.replica_context()
        gathered = ctx.all_gather(x[:, 0])
        labels = ctx.all_gather(tf.cast(x[:, 0], tf.int32))
        weights = tf.range(tf.shape(gathered)[0], dtype=gathered.dtype)
        return {"rows": tf.shape(gathered)[0],
                "weighted": tf.reduce_sum(gathered * weights),
                "labels": tf.reduce_sum(labels * tf.range(
                    tf.shape(labels)[0]))}


def test_all_gather_returns_the_global_rows_in_order(cpus):
    x = np.arange(1, 8, dtype="float32").reshape(7, 1)  # 2/2/2/1
    expected = float(np.sum(x[:, 0] * np.arange(7)))
    mirrored = keras_mirror.MirroredModel(_GatherProbe(), devices=cpus)
    mirrored.compile(optimizer="sgd")
    logs = mirrored.train_on_batch(x, return_dict=True)
    vectors = mirrored.last_replica_logs
    np.testing.assert_array_equal(vectors["rows"], [7] * 4)
    np.testing.assert_allclose(vectors["weighted"], [expected] * 4)
    np.testing.assert_allclose(vectors["labels"], [expected] * 4)
    assert logs["weighted"] == pytest.approx(expected)
    # Outside MirroredModel: one replica holding the batch.
    probe = _GatherProbe()
    probe.compile(optimizer="sgd")
    assert probe.train_on_batch(x, return_dict=True)["weighted"] == \
        pytest.approx(expected)


class GlobalCentering(keras.layers.Layer):
    """Subtracts the batch's mean: the whole global batch's, via all_gather.
    """

    def call(self, x):
        rows = keras_mirror.replica_context().all_gather(x)
        return x - keras.ops.mean(rows, axis=0, keepdims=True)


def _centering_model():
    keras.utils.set_random_seed(4)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(6, activation="tanh"),
        GlobalCentering(),
        keras.layers.Dense(2),
    ])


def _fit_centering(target, x, y):
    target.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse")
    return target.fit(x, y, batch_size=9, epochs=2, shuffle=False,
                      verbose=0)  # 9 = 3/2/2/2; last batch 3 = 1/1/1/0


def test_a_layer_that_gathers_trains_as_on_one_device(cpus):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, 5)).astype("float32")
    y = rng.normal(size=(30, 2)).astype("float32")
    single = _centering_model()
    h1 = _fit_centering(single, x, y)
    model = _centering_model()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus,
                                          execution="strategy")
    h2 = _fit_centering(mirrored, x, y)
    assert max_diff(single.get_weights(), model.get_weights()) < TOL
    np.testing.assert_allclose(h2.history["loss"], h1.history["loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(mirrored.predict(x, verbose=0),
                               single.predict(x, verbose=0), atol=1e-5)


class _GlobalLoss(keras.Model):
    """A loss of the gathered batch only: the same value on every replica.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        ops = keras.ops
        with tf.GradientTape() as tape:
            z = keras_mirror.replica_context().all_gather(self.dense(x))
            centred = z - ops.mean(z, axis=0, keepdims=True)
            loss = ops.logsumexp(ops.matmul(z, ops.transpose(z))) + \
                ops.mean(ops.square(centred))
        variables = self.trainable_weights
        self.optimizer.apply_gradients(
            zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


def _global_loss_model():
    keras.utils.set_random_seed(6)
    model = _GlobalLoss()
    model(np.zeros((1, 5), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_a_loss_of_the_gathered_batch_alone_trains_as_on_one_device(cpus):
    # Each replica's loss is L(Z), one device's: weighted by the shares
    # (summing to 1) before the gather's all-reduce, unweighted after.
    x = np.random.default_rng(3).normal(size=(10, 5)).astype("float32")
    single, model = _global_loss_model(), _global_loss_model()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    for rows in (slice(0, 7), slice(7, 10)):  # 2/2/2/1, then 1/1/1/0
        ref = single.train_on_batch(x[rows], return_dict=True)
        got = mirrored.train_on_batch(x[rows], return_dict=True)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert max_diff(single.get_weights(), model.get_weights()) < TOL
    np.testing.assert_allclose(mirrored.last_replica_logs["loss"],
                               [ref["loss"]] * 3 + [0.0], rtol=1e-6)


class CenteredOnGlobalSum(keras.Model):
    """An own `train_step` whose loss reads a global-batch sum through
    `all_reduce_sum`: the shard's predictions centred on the global mean.
    """

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        ctx = keras_mirror.replica_context(batch_size=tf.shape(x)[0])
        rows = tf.cast(ctx.global_batch_size, tf.float32)
        with tf.GradientTape() as tape:
            pred = self(x)
            mean = ctx.all_reduce_sum(tf.reduce_sum(pred)) / rows
            loss = tf.reduce_mean(tf.square(pred - mean - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_all_reduce_sum_in_an_own_step_is_exactly_differentiated(cpus):
    """Each replica's gradient through `all_reduce_sum` carries every
    replica's share, so uneven and empty shards train as one device."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(15, 4)).astype("float32")
    y = rng.normal(size=(15, 1)).astype("float32")

    def train(wrap):
        keras.utils.set_random_seed(1)
        model = CenteredOnGlobalSum()
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        model(x[:1])
        target = keras_mirror.MirroredModel(model, devices=cpus) \
            if wrap else model
        # Batches of 7, 7, 1: shards 2/2/2/1, 2/2/2/1, 1/0/0/0.
        target.fit(x, y, batch_size=7, epochs=3, shuffle=False, verbose=0)
        return model

    assert max_diff(train(False).get_weights(),
                    train(True).get_weights()) < 1e-5
