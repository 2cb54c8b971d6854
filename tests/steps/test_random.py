"""Exact randomness: a replica's `keras.random` draws are one device's rows.

A draw shaped like the shard (`(batch, k)`, a Dropout mask, `k` stacked
blocks of the batch) gives the rows of the draw one device makes for the
whole global batch; a draw that does not depend on the batch is the same on
every replica; the seed generator advances once per draw, as on one
device. Checked through a `predict_step` that returns its draws, so the
replicas' rows come back in replica order.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops

import keras_mirror


class Draws(keras.Model):
    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(3)
        self.dense = layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        b = ops.shape(x)[0]
        seed = self.seed_generator
        z = keras.random.normal((b, 3), seed=seed)
        blocks = keras.random.uniform((2 * b, 1), seed=seed)
        fixed = keras.random.normal((5,), seed=seed)
        mask = keras.random.dropout(ops.ones((b, 4)), 0.5, seed=seed)
        ints = keras.random.randint((b, 2), 0, 100, seed=seed)
        trunc = keras.random.truncated_normal(ops.shape(x), seed=seed)
        logits = ops.concatenate([x, -x, x * 2.0], axis=1)
        picks = keras.random.categorical(logits, 4, seed=seed)
        return {
            "picks": ops.cast(picks, "float32"),
            "z": z,
            "blocks": ops.transpose(ops.reshape(blocks, (2, b))),
            "fixed": ops.broadcast_to(fixed, (b, 5)),
            "mask": mask,
            "ints": ops.cast(ints, "float32"),
            "trunc": trunc,
        }


def _draws(wrap, execution, x, batch_size):
    keras.utils.set_random_seed(0)
    model = Draws()
    model(x[:1])
    target = keras_mirror.MirroredModel(model, execution=execution) \
        if wrap else model
    out = target.predict(x, batch_size=batch_size, verbose=0)
    return out, model.seed_generator.state.numpy()


@pytest.mark.parametrize("execution", ["strategy"])
def test_replica_draws_are_one_devices_rows(execution, cpus):
    x = np.random.default_rng(0).normal(size=(31, 2)).astype("float32")
    one, state1 = _draws(False, None, x, 10)   # batches 10, 10, 10, 1
    many, state2 = _draws(True, execution, x, 10)
    for key in one:
        np.testing.assert_array_equal(many[key], one[key], err_msg=key)
    np.testing.assert_array_equal(state2, state1)
    # Not correlated across replicas: the rows of a batch all differ.
    assert len({round(float(v), 6) for v in many["z"][:10, 0]}) == 10


@pytest.mark.parametrize("execution", ["strategy"])
def test_dropout_model_trains_as_on_one_device(execution, cpus):
    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input((4,)), layers.Dense(16, activation="relu"),
            layers.Dropout(0.5), layers.GaussianNoise(0.2),
            layers.AlphaDropout(0.1), layers.Dense(1)])
        model.compile("adam", "mse")
        return model

    rng = np.random.default_rng(1)
    x = rng.normal(size=(29, 4)).astype("float32")
    y = rng.normal(size=(29, 1)).astype("float32")
    single = build()
    single.fit(x, y, batch_size=9, epochs=2, shuffle=False, verbose=0)
    model = build()
    keras_mirror.MirroredModel(model, execution=execution).fit(
        x, y, batch_size=9, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)
    for a, b in zip(single.variables, model.variables):
        if "seed" in a.path:
            np.testing.assert_array_equal(b.numpy(), a.numpy())


@pytest.mark.parametrize("shape,layer", [
    ((5, 4), layers.SpatialDropout1D),
    ((3, 3, 4), layers.SpatialDropout2D),
    ((2, 2, 2, 4), layers.SpatialDropout3D),
    ((5, 4), lambda rate: layers.Dropout(rate, noise_shape=(None, 1, 4)))])
def test_dropout_with_a_noise_shape_trains_as_on_one_device(cpus, shape,
                                                            layer):
    """A `noise_shape` with the batch's rows first (`SpatialDropout`'s):
    the probe's doubled batch and the replicas' shards draw one device's
    numbers (the probe crashed on it)."""
    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([
            keras.Input(shape), layers.Dense(4), layer(0.5),
            layers.Flatten(), layers.Dense(1)])
        model.compile("adam", "mse")
        return model

    rng = np.random.default_rng(2)
    x = rng.normal(size=(11,) + shape).astype("float32")
    y = rng.normal(size=(11, 1)).astype("float32")
    single = build()
    single.fit(x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    model = build()
    # Batches of 5, 5, 1: shards 2/1/1/1 and 1/0/0/0.
    keras_mirror.MirroredModel(model, devices=cpus).fit(
        x, y, batch_size=5, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)


@pytest.mark.parametrize("execution", ["strategy"])
def test_shuffle_of_a_shard_differs_per_replica(execution, cpus):
    class Shuffles(Draws):
        def predict_step(self, data):
            x = data[0] if isinstance(data, tuple) else data
            b = ops.shape(x)[0]
            order = ops.cast(ops.arange(b), "float32")
            return keras.random.shuffle(order, seed=self.seed_generator)

    model = Shuffles()
    x = np.zeros((40, 2), "float32")
    model(x[:1])
    mirrored = keras_mirror.MirroredModel(model, execution=execution)
    perms = mirrored.predict(x, batch_size=40, verbose=0).reshape(4, 10)
    for perm in perms:
        assert sorted(perm.tolist()) == list(range(10))
    assert len({tuple(p) for p in perms.tolist()}) == 4


class _Noise(layers.Layer):
    """Adds `keras.random.normal` noise in training, with the given seed."""

    def __init__(self, seed, **kwargs):
        super().__init__(**kwargs)
        self.seed = seed

    def call(self, x, training=False):
        if not training:
            return x
        return x + keras.random.normal(ops.shape(x), seed=self.seed)


def _noisy(seed):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((4,)), _Noise(seed),
                              layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def _xy():
    rng = np.random.default_rng(2)
    return (rng.normal(size=(22, 4)).astype("float32"),
            rng.normal(size=(22, 1)).astype("float32"))


class Diffusion(keras.Model):
    """keras.io's DDIM `train_step`, shrunk: unseeded `keras.random`."""

    def __init__(self):
        super().__init__()
        self.net = keras.Sequential([layers.Dense(8, activation="relu"),
                                     layers.Dense(4)])

    def call(self, x):
        return self.net(x)

    def train_step(self, data):
        images = data
        b = ops.shape(images)[0]
        noises = keras.random.normal(shape=(b, 4))
        times = keras.random.uniform(shape=(b, 1), minval=0.0, maxval=1.0)
        noisy = ops.sqrt(1.0 - times) * images + ops.sqrt(times) * noises
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.abs(self(noisy) - noises))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        return {"loss": loss}


def test_unseeded_draws_train_as_on_one_device(cpus):
    """No `seed`: Keras's global seed generator, shared by the replicas.
    10 rows, batch 7 (shards 2, 2, 2, 1 then 1, 1, 1, 0): one device's
    weights and generator state after 3 epochs; refused before."""
    from keras_mirror import _compat

    x = np.random.default_rng(6).normal(size=(10, 4)).astype("float32")

    def run(wrap):
        keras.utils.set_random_seed(9)   # resets the global generator
        model = Diffusion()
        model(x[:1])
        model.compile(keras.optimizers.Adam(0.01))
        target = keras_mirror.MirroredModel(model, execution="strategy") \
            if wrap else model
        target.fit(x, batch_size=7, epochs=3, shuffle=False, verbose=0)
        return model, _compat.global_seed_generator().state.numpy()

    single, state1 = run(False)
    model, state2 = run(True)
    for a, b in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5)
    np.testing.assert_array_equal(state2, state1)
    assert abs(float(np.sum(single.get_weights()[0]))) > 0


@pytest.mark.parametrize("execution", ["strategy"])
def test_an_int_seed_trains_as_on_one_device(execution, cpus):
    """An int seed draws the same numbers on every replica and on one
    device: the replicas keep their rows of one device's draw."""
    x, y = _xy()
    single = _noisy(11)
    single.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _noisy(11)
    keras_mirror.MirroredModel(model, execution=execution).fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(single.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)


class StatefulNoise(keras.Model):
    """An own `train_step` that draws with a stateful TF op."""

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            noisy = x + tf.random.normal(tf.shape(x))
            loss = ops.mean((self(noisy) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_stateful_tf_draw_is_warned_about_once(cpus):
    """`tf.random.normal` in the step draws per replica (its op keeps its
    own state): one warning at the first trace naming the op, none for
    later traces; no warning where every draw is `keras.random`'s."""
    from keras_mirror.steps import _scope

    x, y = _xy()
    model = StatefulNoise()
    model(x[:1])
    model.compile("sgd")
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    expected = (r"The step draws with stateful TensorFlow random ops "
                r"\(RandomStandardNormal; `tf.random.normal` and the like\): "
                r"each of the 4 replicas draws its own numbers, so training "
                r"is not one device's\. Draw with `keras.random` and a "
                r"`keras.random.SeedGenerator` .* Received: ops "
                r"\['RandomStandardNormal'\] in the replica step")
    with pytest.warns(UserWarning, match=expected) as record:
        mirrored.fit(x, y, batch_size=8, epochs=1, verbose=0)
        mirrored.fit(x[:21], y[:21], batch_size=7, epochs=1, verbose=0)
    assert sum("stateful TensorFlow" in str(w.message) for w in record) == 1
    assert "RandomStandardNormal" in _scope.STATEFUL_RANDOM_OPS
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a SeedGenerator model: no warning
        keras_mirror.MirroredModel(_noisy(11), execution="strategy").fit(
            x, y, batch_size=8, epochs=1, verbose=0)


class StepDraws(keras.Model):
    """An own `train_step` drawing a shard's rows in every way Keras can."""

    def __init__(self):
        super().__init__()
        self.seed_generator = keras.random.SeedGenerator(4)
        self.dense = layers.Dense(1)
        self.dropout = layers.Dropout(0.5, seed=2)

    def call(self, x, training=False):
        return self.dense(self.dropout(x, training=training))

    def train_step(self, data):
        x, y = data
        b = ops.shape(x)[0]
        seed = self.seed_generator
        labels = ops.concatenate([ops.ones((b, 1)), ops.zeros((b, 1))])
        labels = labels + 0.05 * keras.random.uniform((2 * b, 1), seed=seed)
        noise = keras.random.truncated_normal(ops.shape(x), seed=seed)
        picks = keras.random.randint((b, 1), 0, 3, seed=seed)
        x = x + 0.1 * noise * ops.cast(picks, "float32")
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = ops.mean((pred - y) ** 2) + 0.01 * ops.mean(
                (ops.concatenate([pred, pred]) - labels) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_every_draw_in_the_step_makes_its_replicas_rows_only(cpus):
    """Read from the step as TF ran it: each random op of each replica
    outputs its shard's 10 rows (of a 40-row global batch), never the 40
    rows of the global batch (the old gather drew 4x these)."""
    from tests.support.random_ops import random_draw_sizes

    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.normal(size=(40, 1)).astype("float32")
    model = StepDraws()
    model(x[:1])
    model.compile("sgd")
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    sizes = random_draw_sizes(lambda: mirrored.fit(
        x, y, batch_size=40, epochs=1, shuffle=False, verbose=0))
    # Per replica: dropout 10x6, uniform 2 blocks of 10x1, truncated 10x6,
    # randint 10x1 (each flat draw may start up to 3 elements early).
    assert sorted({kind for kind, _ in sizes}) == [
        "StatelessRandomUniformIntV2", "StatelessRandomUniformV2",
        "StatelessTruncatedNormalV2"]
    assert len(sizes) == 4 * 5
    assert all(size <= 10 * 6 + 3 for _, size in sizes), sizes
    assert max(size for _, size in sizes) >= 10 * 6


def test_a_gan_like_step_trains_as_on_one_device(cpus):
    """Seeded uniform (2 stacked blocks), truncated normal, randint and
    Dropout in an own step, 4 replicas, batches 7, 7, 7, 1 (empty
    shards): one device's weights and seed states."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(22, 6)).astype("float32")
    y = rng.normal(size=(22, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(1)
        model = StepDraws()
        model(x[:1])
        model.compile("sgd")
        return model

    single = build()
    single.fit(x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    model = build()
    keras_mirror.MirroredModel(model, execution="strategy").fit(
        x, y, batch_size=7, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(single.variables, model.variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-5,
                                   err_msg=a.path)
