"""Empty and small shards: every layer kind, every batch size, both paths.

A global batch smaller than the replica count leaves shards empty; that is
how most epochs end. TensorFlow 2.21's oneDNN CPU convolution returns a
tensor of the input's shape for 0 rows, so a replica must never run the
user's model on 0 rows: an empty shard runs one stand-in row that counts for
nothing (`keras_mirror/steps/_stand_in.py`). Each model here trains on one
epoch of global batches of 5, 1, 2 and 3 rows (4 replicas: 2/1/1/1, then 1,
2 and 3 replicas busy) and must equal one device within 1e-5, its logged
values and its `evaluate` and `predict` too: each layer kind on one of the
two execution paths, the convolution on both (`PATHS`).

Also the tests of `keras_mirror/steps/_metric_weights.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops
from support.helpers import once

import keras_mirror

TOL = 1e-5
SIZES = (5, 1, 2, 3)  # 4 replicas: 2/1/1/1, 1/0/0/0, 1/1/0/0, 1/1/1/0


def _batches(x, y, sizes=SIZES):
    """A dataset of global batches of `sizes` rows, in order."""
    ds, start = None, 0
    for size in sizes:
        part = (x[start:start + size],) if y is None else (
            x[start:start + size], y[start:start + size])
        part = tf.data.Dataset.from_tensors(part if y is not None
                                            else part[0])
        ds = part if ds is None else ds.concatenate(part)
        start += size
    return ds


def _rng(seed=0):
    return np.random.default_rng(seed)


def _images(rows, shape=(8, 8, 3), seed=0):
    return _rng(seed).normal(size=(rows,) + shape).astype("float32")


def _binary(rows, seed=1):
    return (_rng(seed).uniform(size=(rows, 1)) > 0.5).astype("float32")


def _classes(rows, k, seed=2):
    return _rng(seed).integers(0, k, size=(rows,)).astype("int32")


def _seq(*body, shape):
    return keras.Sequential([keras.Input(shape), *body])


# -- built-in step models: (model, compile kwargs, x, y) ----------------------

def conv2d():
    m = _seq(layers.Conv2D(8, 3, strides=2, padding="same"), layers.ReLU(),
             layers.Flatten(), layers.Dense(1), shape=(8, 8, 3))
    return m, dict(loss=keras.losses.BinaryCrossentropy(from_logits=True),
                   metrics=["accuracy"]), _images(11), _binary(11)


def conv1d():
    m = _seq(layers.Conv1D(4, 3, activation="relu"),
             layers.GlobalAveragePooling1D(), layers.Dense(3), shape=(12, 3))
    return m, dict(loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["sparse_categorical_accuracy"]), \
        _images(11, (12, 3)), _classes(11, 3)


def conv3d():
    m = _seq(layers.Conv3D(3, 2, activation="relu"), layers.Flatten(),
             layers.Dense(1), shape=(4, 4, 4, 2))
    return m, dict(loss="mse"), _images(11, (4, 4, 4, 2)), _binary(11)


def conv_transpose():
    m = _seq(layers.Conv2DTranspose(4, 3, strides=2, padding="same"),
             layers.Conv2D(2, 3), layers.GlobalMaxPooling2D(),
             layers.Dense(1), shape=(4, 4, 3))
    return m, dict(loss="mse"), _images(11, (4, 4, 3)), _binary(11)


def depthwise_separable_pooling():
    m = _seq(layers.DepthwiseConv2D(3, padding="same"),
             layers.SeparableConv2D(4, 3, padding="same"),
             layers.AveragePooling2D(2), layers.MaxPooling2D(2),
             layers.Flatten(), layers.Dense(4), shape=(8, 8, 3))
    y = keras.utils.to_categorical(_classes(11, 4), 4)
    return m, dict(loss=keras.losses.CategoricalCrossentropy(
        from_logits=True), metrics=["categorical_accuracy"]), _images(11), y


def layer_norm():
    m = _seq(layers.Conv2D(4, 3), layers.LayerNormalization(),
             layers.GlobalAveragePooling2D(), layers.Dense(1),
             shape=(8, 8, 3))
    return m, dict(loss="mse", metrics=["mae"]), _images(11), _binary(11)


def lstm_masked():
    tokens = _rng(3).integers(1, 20, size=(11, 7)).astype("int32")
    tokens[:, 5:] = 0  # padding, masked
    m = _seq(layers.Embedding(20, 4, mask_zero=True), layers.LSTM(5),
             layers.Dense(3), shape=(7,))
    return m, dict(loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)), tokens, _classes(11, 3)


def gru_masked():
    x = _images(11, (6, 3))
    x[:, 4:] = 0.0
    m = _seq(layers.Masking(0.0), layers.GRU(4), layers.Dense(1),
             shape=(6, 3))
    return m, dict(loss="mse"), x, _binary(11)


def attention():  # (SGD in `_train`: see there)
    inputs = keras.Input((5, 8))
    h = layers.MultiHeadAttention(2, 4)(inputs, inputs)
    h = layers.GlobalAveragePooling1D()(h)
    m = keras.Model(inputs, layers.Dense(1)(h))
    return m, dict(loss="mse"), _images(11, (5, 8)), _binary(11)


BUILT_IN = {f.__name__: f for f in (
    conv2d, conv1d, conv3d, conv_transpose, depthwise_separable_pooling,
    layer_norm, lstm_masked, gru_masked, attention)}


def _train(builder, wrap, execution="auto", devices=None, sizes=SIZES):
    keras.utils.set_random_seed(7)
    model, kwargs, x, y = builder()
    # SGD: Adam turns float noise in a gradient that is 0 in exact
    # arithmetic (a bias before BatchNorm, attention key biases) into steps
    # of its learning rate, on one device too.
    # Plain SGD at a small rate: oneDNN's 3-D and transposed convolutions
    # sum a batch's gradient in an order that depends on its rows, and
    # momentum would carry that float noise (1e-7) past the tolerance.
    model.compile(optimizer=keras.optimizers.SGD(0.02), **kwargs)
    target = model
    if wrap:
        target = keras_mirror.MirroredModel(model, devices=devices,
                                            execution=execution)
    history = target.fit(_batches(x, y, sizes), epochs=2, verbose=0)
    return model, target, history.history, _batches(x, y, sizes)


def _assert_weights_equal(weights, model):
    diff = max(float(np.max(np.abs(u - v)))
               for u, v in zip(weights, model.get_weights()))
    assert diff < TOL, diff


def _assert_same_weights(a, b):
    _assert_weights_equal(a.get_weights(), b)


def _assert_logs(single, mirrored):
    for key, values in single.items():
        np.testing.assert_allclose(mirrored[key], values, rtol=2e-5,
                                   atol=2e-6, err_msg=key)


def _single(cache, builder, sizes=SIZES):
    def run():
        single, _, logs, ds = _train(builder, wrap=False, sizes=sizes)
        return (single.get_weights(), logs, single.evaluate(ds, verbose=0),
                single.predict(ds.map(lambda x, y: x), verbose=0))

    return once(cache, (builder.__name__, sizes), run)


# Every layer kind in the replica's forward and backward pass, on its shard,
# its stand-in row and its loss share, on the one path.
@pytest.mark.parametrize("name,execution", [
    (name, "strategy") for name in sorted(BUILT_IN)])
def test_every_layer_kind_trains_as_one_device(name, execution, cpus,
                                              one_device):
    weights, logs1, evaluated, predicted = _single(one_device, BUILT_IN[name])
    model, mirrored, logs2, ds = _train(BUILT_IN[name], wrap=True,
                                        execution=execution)
    _assert_weights_equal(weights, model)
    _assert_logs(logs1, logs2)
    np.testing.assert_allclose(mirrored.evaluate(ds, verbose=0), evaluated,
                               rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        mirrored.predict(ds.map(lambda x, y: x), verbose=0), predicted,
        atol=1e-5)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("execution", ["strategy"])
def test_every_last_batch_size_below_the_replica_count(replicas, execution,
                                                      cpus, one_device):
    # B < N, B = N + 1 and every last-batch size 1 .. N-1.
    sizes = (replicas + 1,) + tuple(range(1, replicas)) + (replicas,)
    weights, logs1, _, _ = _single(one_device, conv2d, sizes)
    model, _, logs2, _ = _train(conv2d, wrap=True, execution=execution,
                                devices=cpus[:replicas], sizes=sizes)
    _assert_weights_equal(weights, model)
    _assert_logs(logs1, logs2)


def test_on_batch_methods_with_empty_shards(cpus, execution):
    keras.utils.set_random_seed(7)
    single, kwargs, x, y = conv2d()
    single.compile(optimizer="adam", **kwargs)
    keras.utils.set_random_seed(7)
    model, kwargs, _, _ = conv2d()
    model.compile(optimizer="adam", **kwargs)
    mirrored = keras_mirror.MirroredModel(model)
    for rows in (1, 3, 2):
        a = single.train_on_batch(x[:rows], y[:rows], return_dict=True)
        b = mirrored.train_on_batch(x[:rows], y[:rows], return_dict=True)
        _assert_logs(a, b)
    _assert_same_weights(single, model)
    np.testing.assert_allclose(mirrored.predict_on_batch(x[:2]),
                               single.predict_on_batch(x[:2]), atol=1e-6)
    _assert_logs(single.test_on_batch(x[:1], y[:1], return_dict=True),
                 mirrored.test_on_batch(x[:1], y[:1], return_dict=True))


# -- batch normalisation -----------------------------------------------------

def _bn_model(synchronized):
    return _seq(layers.Conv2D(4, 3), layers.BatchNormalization(
        synchronized=synchronized), layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dense(1), shape=(8, 8, 3))


def test_synchronized_batch_norm_is_exact_with_empty_shards(cpus):
    """The stand-in rows stay out of the cross-replica statistics."""

    def build():
        return _bn_model(True), dict(loss="mse"), _images(11), _binary(11)

    single, _, logs1, _ = _train(build, wrap=False)
    model, mirrored, logs2, _ = _train(build, wrap=True)
    assert mirrored.execution == "strategy"
    _assert_same_weights(single, model)
    _assert_logs(logs1, logs2)


def resnet_block(synchronized=True):
    """keras.io ResNet shape: a MaxPool stem, a residual block with BN.

    An empty replica's MaxPool on 0 rows aborts the process with oneDNN on
    (heap corruption, `benchmarks/results/shard_shapes/findings.md`).
    """
    inputs = keras.Input((8, 8, 3))
    x = layers.MaxPooling2D()(layers.Conv2D(4, 3, padding="same")(inputs))
    y = layers.Conv2D(4, 3, padding="same")(x)
    y = layers.BatchNormalization(synchronized=synchronized)(y)
    y = layers.Conv2D(4, 3, padding="same")(layers.ReLU()(y))
    y = layers.BatchNormalization(synchronized=synchronized)(y)
    x = layers.ReLU()(layers.add([x, y]))
    outputs = layers.Dense(3)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs), dict(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"]), _images(11), _classes(11, 3)


def test_a_resnet_with_maxpool_and_synchronized_batch_norm(cpus):
    single, _, logs1, _ = _train(resnet_block, wrap=False)
    model, mirrored, logs2, _ = _train(resnet_block, wrap=True)
    assert mirrored.execution == "strategy"
    _assert_same_weights(single, model)
    _assert_logs(logs1, logs2)


def test_plain_batch_norm_with_empty_shards_keeps_replica_0s_state(cpus):
    """Plain BatchNorm: each shard's statistics, replica 0's moving ones.

    With global batches of 1 row only replica 0 has data, so every step
    equals one device's step on that row, moving statistics included.
    """

    def build():
        return _bn_model(False), dict(loss="mse"), _images(11), _binary(11)

    ones = (1,) * 6
    single, _, _, _ = _train(build, wrap=False, sizes=ones)
    model, _, _, _ = _train(build, wrap=True, execution="strategy",
                            sizes=ones)
    _assert_same_weights(single, model)


# -- models with their own train_step (keras.io style, convolutional) ---------

class ConvGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")
        self.d_accuracy = keras.metrics.BinaryAccuracy(name="d_acc")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric, self.d_accuracy]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim),
                                     seed=self.seed_generator)
        generated = self.generator(latent)
        combined = ops.concatenate([generated, real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)),
                                  ops.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights))
        self.d_accuracy.update_state(labels, ops.sigmoid(predictions))
        latent = keras.random.normal((batch_size, self.latent_dim),
                                     seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(latent))
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)), predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(
            zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def conv_gan():
    latent = 4
    discriminator = _seq(layers.Conv2D(4, 3, strides=2, padding="same"),
                         layers.LeakyReLU(0.2), layers.Flatten(),
                         layers.Dense(1), shape=(8, 8, 3))
    generator = _seq(layers.Dense(4 * 4 * 4), layers.Reshape((4, 4, 4)),
                     layers.Conv2DTranspose(3, 3, strides=2, padding="same",
                                            activation="tanh"),
                     shape=(latent,))
    model = ConvGAN(discriminator, generator, latent)
    kwargs = dict(d_optimizer=keras.optimizers.Adam(1e-3),
                  g_optimizer=keras.optimizers.Adam(1e-3),
                  loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return model, kwargs, _images(11), None


class Sampling(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean),
                                      seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class ConvVAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction),
                axis=(1, 2)))
            kl = -0.5 * (1 + z_log_var - ops.square(z_mean)
                         - ops.exp(z_log_var))
            total = reconstruction_loss + ops.mean(ops.sum(kl, axis=1))
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total)
        return {"loss": self.total_loss_tracker.result()}


def conv_vae():
    inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")(
        inputs)
    h = layers.Flatten()(h)
    z_mean = layers.Dense(2)(h)
    z_log_var = layers.Dense(2)(h)
    encoder = keras.Model(inputs, [z_mean, z_log_var,
                                   Sampling()([z_mean, z_log_var])])
    latent = keras.Input((2,))
    h = layers.Dense(4 * 4 * 4, activation="relu")(latent)
    h = layers.Reshape((4, 4, 4))(h)
    out = layers.Conv2DTranspose(1, 3, strides=2, padding="same",
                                 activation="sigmoid")(h)
    decoder = keras.Model(latent, out)
    x = _rng(5).uniform(size=(11, 8, 8, 1)).astype("float32")
    return ConvVAE(encoder, decoder), dict(
        optimizer=keras.optimizers.Adam(1e-2)), x, None


@pytest.mark.parametrize("builder", [conv_gan, conv_vae])
def test_own_train_step_convnets_with_empty_shards(builder, cpus):
    def train(wrap):
        keras.utils.set_random_seed(7)
        model, kwargs, x, _ = builder()
        model.compile(**kwargs)
        target = keras_mirror.MirroredModel(model) if wrap else model
        history = target.fit(_batches(x, None), epochs=2, verbose=0)
        return model, history.history

    single, logs1 = train(False)
    model, logs2 = train(True)
    _assert_same_weights(single, model)
    _assert_logs(logs1, logs2)
    for a, b in zip(single.weights, model.weights):  # seed generators too
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=TOL,
                                   err_msg=a.path)


def test_own_test_and_predict_steps_with_empty_shards(cpus, execution):
    class OwnTest(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = layers.Conv2D(4, 3)
            self.head = layers.Dense(1)
            self.acc = keras.metrics.BinaryAccuracy(name="acc")

        def call(self, x):
            return self.head(ops.mean(self.conv(x), axis=(1, 2)))

        @property
        def metrics(self):
            return [self.acc]

        def test_step(self, data):
            x, y = data
            self.acc.update_state(y, ops.sigmoid(self(x)))
            return {"acc": self.acc.result()}

        def predict_step(self, data):
            return ops.sigmoid(self(data))

    def build():
        keras.utils.set_random_seed(7)
        model = OwnTest()
        model.compile(optimizer="sgd", loss="mse")
        model(_images(1))
        return model

    x, y = _images(11), _binary(11)
    single, model = build(), build()
    mirrored = keras_mirror.MirroredModel(model)
    ds = _batches(x, y)
    _assert_logs(single.evaluate(ds, verbose=0, return_dict=True),
                 mirrored.evaluate(ds, verbose=0, return_dict=True))
    np.testing.assert_allclose(
        mirrored.predict(ds.map(lambda a, b: a), verbose=0),
        single.predict(ds.map(lambda a, b: a), verbose=0), atol=1e-6)


def test_per_replica_batches_with_a_short_last_group(cpus, execution):
    """`batch="per_replica"`: a short final group leaves replicas empty."""
    # Replica batches of 3: a step of 4 x 3 rows, then one of 2 rows
    # (2/0/0/0 by the fill rule).
    x, y = _images(14), _binary(14)

    def train(wrap):
        keras.utils.set_random_seed(7)
        model, kwargs, _, _ = conv2d()
        model.compile(optimizer=keras.optimizers.SGD(0.05), **kwargs)
        if not wrap:
            model.fit(_batches(x, y, (12, 2)), verbose=0)
            return model
        mirrored = keras_mirror.MirroredModel(model, batch="per_replica")
        mirrored.fit(x, y, batch_size=3, shuffle=False, verbose=0)
        assert mirrored.replica_history["samples"] == [[5, 3, 3, 3]]
        return model

    _assert_same_weights(train(False), train(True))


def test_stateful_rnn_is_refused_at_wrap_time(cpus):
    model = keras.Sequential([
        keras.Input((5, 3), batch_size=8),
        layers.LSTM(4, stateful=True, name="lstm"), layers.Dense(1)])
    with pytest.raises(ValueError, match=(
            r"cannot split a stateful RNN over 4 replicas: the layers "
            r"\['lstm'\] keep one state row per row of the batch.*"
            r"Received: model with stateful layers \['lstm'\] and 4 "
            r"replicas")):
        keras_mirror.MirroredModel(model)
    bidirectional = keras.Sequential([
        keras.Input((5, 3), batch_size=8),
        layers.Bidirectional(layers.GRU(2, stateful=True, name="gru"))])
    with pytest.raises(ValueError, match=r"stateful layers \["):
        keras_mirror.MirroredModel(bidirectional)
    # Not stateful: accepted.
    keras_mirror.MirroredModel(keras.Sequential([
        keras.Input((5, 3)), layers.LSTM(4), layers.Dense(1)]))
