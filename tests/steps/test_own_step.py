"""Models with their own `train_step` (GANs, several optimizers): exactness."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror

# First global batch smaller than 4 replicas (an empty shard), then even,
# uneven, uneven, a single row.
BATCHES = (3, 8, 7, 5, 1)
LATENT = 3


class GAN(keras.Model):
    """keras.io DCGAN pattern, with the latent noise passed in as data."""

    def __init__(self, discriminator, generator, d_steps=2, **kwargs):
        super().__init__(**kwargs)
        self.discriminator = discriminator
        self.generator = generator
        self.d_steps = d_steps

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, data):
        real, noise = keras.utils.unpack_x_y_sample_weight(data)[0]
        rows = tf.shape(real)[0]
        labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], 0)
        d_vars = self.discriminator.trainable_weights
        for _ in range(self.d_steps):
            with tf.GradientTape() as tape:
                fake = self.generator(noise)
                pred = self.discriminator(tf.concat([fake, real], 0))
                d_loss = self.loss_fn(labels, pred)
            grads = tape.gradient(d_loss, d_vars)
            self.d_optimizer.apply_gradients(zip(grads, d_vars))
        g_vars = self.generator.trainable_weights
        with tf.GradientTape() as tape:
            pred = self.discriminator(self.generator(noise))
            # A hand-written mean: 0/0 = NaN on an empty shard.
            g_loss = tf.reduce_mean(
                keras.losses.binary_crossentropy(
                    tf.zeros((rows, 1)), pred, from_logits=True))
        grads = tape.gradient(g_loss, g_vars)
        self.g_optimizer.apply_gradients(zip(grads, g_vars))
        return {"d_loss": d_loss, "g_loss": g_loss}

    def test_step(self, data):
        real, noise = keras.utils.unpack_x_y_sample_weight(data)[0]
        rows = tf.shape(real)[0]
        pred = self.discriminator(real)
        ctx = keras_mirror.replica_context()
        accuracy = tf.reduce_mean(tf.cast(pred > 0, tf.float32))
        return {
            "real_loss": self.loss_fn(tf.zeros((rows, 1)), pred),
            "accuracy": ctx.all_reduce_mean(accuracy),
        }


def make_gan():
    keras.utils.set_random_seed(3)
    discriminator = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])
    generator = keras.Sequential([
        keras.Input((LATENT,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(4),
    ])
    return GAN(discriminator, generator)


def compile_gan(model):
    model.compile(
        d_optimizer=keras.optimizers.Adam(0.01),
        g_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )


def gan_data(rows, seed=5):
    rng = np.random.default_rng(seed)
    real = rng.normal(size=(rows, 4)).astype("float32")
    noise = rng.normal(size=(rows, LATENT)).astype("float32")
    return real, noise


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def trained(request):
    """Reference and mirrored GANs stepped on BATCHES; logs of each step."""
    cpus = keras_mirror.logical_cpus(4)
    keras.backend.clear_session()
    reference = make_gan()
    compile_gan(reference)
    mirrored = keras_mirror.MirroredModel(make_gan, devices=cpus)
    compile_gan(mirrored)
    start_diff = max_diff(reference.get_weights(),
                          mirrored.model.get_weights())
    real, noise = gan_data(sum(BATCHES))
    logs, start = [], 0
    for rows in BATCHES:
        batch = (real[start:start + rows], noise[start:start + rows])
        ref = reference.train_on_batch(batch, return_dict=True)
        got = mirrored.train_on_batch(batch, return_dict=True)
        assert set(got) == set(ref)  # plain Keras's keys
        got.update({f"replica_{k}": v
                    for k, v in mirrored.last_replica_logs.items()})
        logs.append((rows, ref, got))
        start += rows
    return reference, mirrored, logs, start_diff


def test_custom_step_equals_single_device(trained):
    reference, mirrored, _, start_diff = trained
    assert start_diff == 0.0
    diff = max_diff(reference.get_weights(), mirrored.model.get_weights())
    print(f"custom-step max weight difference: {diff:.3g}")
    assert diff < 1e-5
    assert int(mirrored._inner.d_optimizer.iterations.numpy()) == \
        2 * len(BATCHES)
    assert int(mirrored.optimizer.iterations.numpy()) == len(BATCHES)


def test_global_logs_are_exact_and_finite_with_empty_shards(trained):
    _, _, logs, _ = trained
    for _, ref, got in logs:
        for key in ("d_loss", "g_loss"):
            assert np.isfinite(got[key])
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6)


def test_per_replica_vectors(trained):
    _, mirrored, logs, _ = trained
    for rows, _, got in logs:
        plan = mirrored.split_plan(rows)
        np.testing.assert_array_equal(got["replica_samples"], plan)
        for key in ("d_loss", "g_loss"):
            vector = np.asarray(got[f"replica_{key}"])
            assert vector.shape == (4,)
            share = np.asarray(plan) / rows
            weighted = np.where(share > 0, vector * share, 0.0).sum()
            assert weighted == pytest.approx(got[key], rel=1e-5, abs=1e-6)
    # B=3: the last replica holds nothing; B=1: only the first holds a row.
    assert list(logs[0][2]["replica_samples"]) == [1, 1, 1, 0]
    assert list(logs[-1][2]["replica_samples"]) == [1, 0, 0, 0]


def test_custom_test_step_and_replica_context_mean(cpus):
    mirrored = keras_mirror.MirroredModel(make_gan, devices=cpus)
    compile_gan(mirrored)
    reference = make_gan()
    compile_gan(reference)
    real, noise = gan_data(7, seed=9)
    got = mirrored.test_on_batch((real, noise), return_dict=True)
    ref = reference.test_on_batch((real, noise), return_dict=True)
    assert got["real_loss"] == pytest.approx(ref["real_loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(ref["accuracy"], abs=1e-6)
    # all_reduce_mean already made it global: every replica reports it.
    assert set(got) == set(ref)
    np.testing.assert_allclose(mirrored.last_replica_logs["accuracy"],
                               [ref["accuracy"]] * 4, atol=1e-6)


def test_fit_runs_and_reports_replica_vectors(cpus):
    mirrored = keras_mirror.MirroredModel(make_gan, devices=cpus)
    compile_gan(mirrored)
    real, noise = gan_data(22)
    ds = tf.data.Dataset.from_tensor_slices(((real, noise),)).batch(8)
    history = mirrored.fit(ds, epochs=2, verbose=0)
    assert {"d_loss", "g_loss"} <= set(history.history)
    assert len(mirrored.replica_history["d_loss"]) == 2
    assert len(mirrored.replica_history["d_loss"][0]) == 4
    assert int(mirrored.optimizer.iterations.numpy()) == 6


class _Probe(keras.Model):
    """Returns what `replica_context()` says inside the step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)
        self.dense.build((None, 2))

    def train_step(self, data):
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        ctx = keras_mirror.replica_context(batch_size=tf.shape(x)[0])
        shard_mean = tf.reduce_mean(x)
        return {
            "replica_id": ctx.replica_id,
            "num_replicas": ctx.num_replicas,
            "shard_size": ctx.shard_size,
            "global_batch_size": ctx.global_batch_size,
            "share": ctx.share,
            "sum": ctx.all_reduce_sum(tf.reduce_sum(x)),
            "mean": ctx.all_reduce_mean(shard_mean),
        }


def test_replica_context_inside_mirrored_model(cpus):
    mirrored = keras_mirror.MirroredModel(_Probe, devices=cpus)
    mirrored.compile(optimizer="sgd")
    x = np.arange(14, dtype="float32").reshape(7, 2)
    mirrored.train_on_batch(x, return_dict=True)
    logs = mirrored.last_replica_logs
    np.testing.assert_array_equal(logs["replica_id"], [0, 1, 2, 3])
    np.testing.assert_array_equal(logs["num_replicas"], [4] * 4)
    np.testing.assert_array_equal(logs["shard_size"], [2, 2, 2, 1])
    np.testing.assert_array_equal(logs["global_batch_size"], [7] * 4)
    np.testing.assert_allclose(logs["share"], [2 / 7] * 3 + [1 / 7])
    np.testing.assert_allclose(logs["sum"], [x.sum()] * 4)
    np.testing.assert_allclose(logs["mean"], [x.mean()] * 4, rtol=1e-6)


def test_replica_context_outside_is_a_single_replica():
    ctx = keras_mirror.replica_context(batch_size=5)
    assert (ctx.replica_id, ctx.num_replicas) == (0, 1)
    assert (ctx.shard_size, ctx.global_batch_size, ctx.share) == (5, 5, 1.0)
    assert ctx.all_reduce_mean(2.5) == 2.5
    assert ctx.all_reduce_sum(3.0) == 3.0
    probe = _Probe()
    probe.compile(optimizer="sgd")
    logs = probe.train_on_batch(np.ones((3, 2), "float32"),
                                return_dict=True)
    assert logs["num_replicas"] == 1 and logs["share"] == 1.0
    assert logs["mean"] == 1.0


def test_stock_keras_differs_on_uneven_batches_and_we_do_not(cpus):
    # Stock fit crashes when the first global batch doesn't split evenly:
    # first batch 8 (even), then 5 (uneven: 2/1/1/1).
    real, noise = gan_data(13, seed=11)
    ds = tf.data.Dataset.from_tensor_slices(((real, noise),)).batch(8)
    reference = make_gan()
    compile_gan(reference)
    reference.fit(ds, epochs=1, verbose=0, shuffle=False)

    strategy = tf.distribute.MirroredStrategy(cpus)
    with strategy.scope():
        stock = make_gan()
        compile_gan(stock)
        stock.built = True
        # Built here: stock Keras fails to create them inside its step.
        stock.d_optimizer.build(stock.discriminator.trainable_variables)
        stock.g_optimizer.build(stock.generator.trainable_variables)
    stock.fit(ds, epochs=1, verbose=0, shuffle=False)

    mirrored = keras_mirror.MirroredModel(make_gan, devices=cpus)
    compile_gan(mirrored)
    mirrored.fit(ds, epochs=1, verbose=0, shuffle=False)

    stock_error = max_diff(reference.get_weights(), stock.get_weights())
    ours = max_diff(reference.get_weights(), mirrored.model.get_weights())
    print(f"stock error {stock_error:.3g}, keras-mirror error {ours:.3g}")
    assert stock_error > 1e-3
    assert ours < 1e-5
