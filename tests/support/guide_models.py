"""Keras-guide-style models, written as users write them (not for us).

Each builder takes no arguments and returns `(model, compile_kwargs, data)`,
where `data` is `(x, y)` NumPy arrays (y may be None). Nothing here knows
about keras-mirror: sub-models passed to `__init__`, layers without
`get_config`, seed generators, `add_loss`, metrics created in `__init__`,
unregistered loss functions.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

ROWS = 45  # batches of 14: 14, 14, 14, 3 (the last smaller than 4 replicas)
BATCH = 14


def _rng(seed=0):
    return np.random.default_rng(seed)


# -- GAN (keras.io DCGAN style) ----------------------------------------------


class GAN(keras.Model):
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

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = ops.concatenate([generated_images, real_images],
                                          axis=0)
        labels = ops.concatenate(
            [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(ops.shape(labels),
                                              seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights))
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = ops.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(
                self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(
            zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(),
                "g_loss": self.g_loss_metric.result()}


def gan():
    latent = 4
    discriminator = keras.Sequential([
        keras.Input((6,)), layers.Dense(8), layers.LeakyReLU(0.2),
        layers.Dropout(0.2), layers.Dense(1)], name="discriminator")
    generator = keras.Sequential([
        keras.Input((latent,)), layers.Dense(8), layers.LeakyReLU(0.2),
        layers.Dense(6, activation="tanh")], name="generator")
    model = GAN(discriminator, generator, latent)
    compile_kwargs = dict(
        d_optimizer=keras.optimizers.Adam(1e-3),
        g_optimizer=keras.optimizers.Adam(1e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    x = _rng(1).normal(size=(ROWS, 6)).astype("float32")
    return model, compile_kwargs, (x, None)


# -- WGAN-GP (keras.io style: several critic steps, gradient penalty) ---------


class WGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim,
                 discriminator_extra_steps=2, gp_weight=10.0):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight
        self.seed_generator = keras.random.SeedGenerator(7)

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        alpha = keras.random.uniform([batch_size, 1], 0.0, 1.0,
                                     seed=self.seed_generator)
        interpolated = real_images + alpha * (fake_images - real_images)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = ops.sqrt(ops.sum(ops.square(grads), axis=1))
        return ops.mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        batch_size = ops.shape(real_images)[0]
        for _ in range(self.d_steps):
            random_latent_vectors = keras.random.normal(
                shape=(batch_size, self.latent_dim), seed=self.seed_generator)
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors,
                                             training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits,
                                        fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images,
                                           fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss,
                                       self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables))
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors,
                                              training=True)
            gen_img_logits = self.discriminator(generated_images,
                                                training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss,
                                     self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(
            zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


def wgan_gp():
    latent = 3
    discriminator = keras.Sequential([
        keras.Input((5,)), layers.Dense(8), layers.LeakyReLU(0.2),
        layers.Dense(1)])
    generator = keras.Sequential([
        keras.Input((latent,)), layers.Dense(8, activation="relu"),
        layers.Dense(5)])
    model = WGAN(discriminator, generator, latent)

    def discriminator_loss(real_img, fake_img):
        return ops.mean(fake_img) - ops.mean(real_img)

    def generator_loss(fake_img):
        return -ops.mean(fake_img)

    compile_kwargs = dict(
        d_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9),
        d_loss_fn=discriminator_loss, g_loss_fn=generator_loss)
    x = _rng(2).normal(size=(ROWS, 5)).astype("float32")
    return model, compile_kwargs, (x, None)



def wgan_gp_bn():
    """The WGAN-GP with BatchNorm: synchronized in the critic (its gradient
    penalty differentiates through the statistics twice), plain in the
    generator (no bias before either: Adam would turn its rounding-level
    gradient into steps of the learning rate's size)."""
    latent = 3
    discriminator = keras.Sequential([
        keras.Input((5,)), layers.Dense(8, use_bias=False),
        layers.BatchNormalization(synchronized=True), layers.LeakyReLU(0.2),
        layers.Dense(1)])
    generator = keras.Sequential([
        keras.Input((latent,)), layers.Dense(8, use_bias=False),
        layers.BatchNormalization(), layers.ReLU(), layers.Dense(5)])
    _, compile_kwargs, _ = wgan_gp()
    # SGD: Adam's step divides by the root of the squared gradients, so
    # weights whose gradients are near 0 turn rounding into steps of the
    # learning rate's size (1e-3 apart with Adam, one device against one
    # device with data perturbed by 2e-7, too).
    compile_kwargs.update(d_optimizer=keras.optimizers.SGD(0.01),
                          g_optimizer=keras.optimizers.SGD(0.01))
    model = WGAN(discriminator, generator, latent)
    # 4 batches of 14 (4/4/3/3 rows a replica): a BatchNorm of a 3-row
    # batch under a gradient penalty is so ill-conditioned that data
    # perturbed by 2e-7 moves one device's weights by 1e-4 (empty shards
    # with BatchNorm in an own step: tests/steps/test_batchnorm.py).
    x = _rng(2).normal(size=(4 * BATCH, 5)).astype("float32")
    return model, compile_kwargs, (x, None)

# -- VAE (keras.io style: a sampling layer with its own seed generator) ------


class Sampling(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim),
                                      seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(
            name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction),
                axis=-1))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean)
                              - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss":
                    self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def vae():
    latent = 2
    inputs = keras.Input((3, 4))
    h = layers.Flatten()(inputs)
    h = layers.Dense(8, activation="relu")(h)
    z_mean = layers.Dense(latent, name="z_mean")(h)
    z_log_var = layers.Dense(latent, name="z_log_var")(h)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input((latent,))
    h = layers.Dense(12, activation="sigmoid")(latent_inputs)
    decoder = keras.Model(latent_inputs, layers.Reshape((3, 4))(h),
                          name="decoder")
    model = VAE(encoder, decoder)
    x = _rng(3).uniform(size=(ROWS, 3, 4)).astype("float32")
    return model, dict(optimizer=keras.optimizers.Adam(1e-2)), (x, None)


# -- a transformer text classifier (token + position embeddings) -------------


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads,
                                             key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


def transformer():
    maxlen, vocab = 6, 20
    inputs = layers.Input(shape=(maxlen,))
    x = TokenAndPositionEmbedding(maxlen, vocab, 8)(inputs)
    x = TransformerBlock(8, 2, 8)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    rng = _rng(4)
    x = rng.integers(0, vocab, size=(ROWS, maxlen)).astype("int32")
    y = rng.integers(0, 2, size=(ROWS,)).astype("int32")
    return model, dict(optimizer=keras.optimizers.Adam(1e-2),
                       loss="sparse_categorical_crossentropy",
                       metrics=["accuracy"]), (x, y)


# -- a custom layer without get_config or **kwargs ---------------------------


class Linear(layers.Layer):
    def __init__(self, units):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units),
                                 initializer="random_normal")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros")

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class NoConfigModel(keras.Model):
    def __init__(self, hidden):
        super().__init__()
        self.l1 = Linear(hidden)
        self.l2 = Linear(1)

    def call(self, x):
        return self.l2(ops.tanh(self.l1(x)))


def no_config():
    model = NoConfigModel(8)
    rng = _rng(5)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    model(x[:1])
    return model, dict(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                       loss="mse"), (x, y)


# -- overriding compute_loss ---------------------------------------------------


class PenalisedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 100 * ops.mean(y_pred ** 2)


def compute_loss_override():
    rng = _rng(6)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    return PenalisedModel(), dict(optimizer=keras.optimizers.Adam(1e-2),
                                  loss="mse"), (x, y)


# -- overriding test_step only -------------------------------------------------


class OwnTest(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(2)
        self.mae_tracker = keras.metrics.Mean(name="own_mae")

    def call(self, x):
        return self.dense(x)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.mae_tracker.update_state(ops.mean(ops.abs(y - y_pred)))
        return {"own_mae": self.mae_tracker.result()}

    @property
    def metrics(self):
        return [self.mae_tracker]


def test_step_override():
    rng = _rng(7)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    return OwnTest(), dict(optimizer="sgd", loss="mse"), (x, y)


# -- the guide's custom train_step with compiled metrics and sample weights ---


class GuideModel(keras.Model):
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred,
                                     sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


def guide_train_step():
    inputs = keras.Input(shape=(4,))
    outputs = layers.Dense(1)(layers.Dense(6, activation="relu")(inputs))
    model = GuideModel(inputs, outputs)
    rng = _rng(8)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    return model, dict(optimizer="adam", loss="mse", metrics=["mae"]), (x, y)


# -- a custom metric class and an unregistered loss function -----------------


class TruePositives(keras.metrics.Metric):
    def __init__(self, name="true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), initializer="zeros",
                                                name="tp")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(ops.equal(ops.cast(y_true, "int32"),
                                    ops.cast(y_pred, "int32")), "float32")
        if sample_weight is not None:
            values = values * ops.reshape(ops.cast(sample_weight, "float32"),
                                          (-1, 1))
        self.true_positives.assign_add(ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


def custom_objects():
    def my_loss(y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True) * 0.5

    model = keras.Sequential([keras.Input((5,)),
                              layers.Dense(8, activation="relu"),
                              layers.Dense(3)])
    rng = _rng(9)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS, 1)).astype("int32")
    return model, dict(optimizer="rmsprop", loss=my_loss,
                       metrics=[TruePositives()]), (x, y)


# -- add_loss as a batch sum (the guide's activity regularisation layer) -----


class ActivityRegularization(layers.Layer):
    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.sum(inputs))
        return inputs


def sum_add_loss():
    inputs = keras.Input((4,))
    h = layers.Dense(6, activation="relu")(inputs)
    h = ActivityRegularization(0.1)(h)
    model = keras.Model(inputs, layers.Dense(2)(h))
    rng = _rng(10)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    return model, dict(optimizer="adam", loss="mse"), (x, y)


class SumSquaredError(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return ops.sum(ops.square(y_true - y_pred))


def sum_loss():
    model = keras.Sequential([keras.Input((4,)), layers.Dense(2)])
    rng = _rng(11)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    return model, dict(optimizer=keras.optimizers.SGD(1e-3),
                       loss=SumSquaredError()), (x, y)


# -- dropout and noise in a plain model ---------------------------------------


def noisy():
    model = keras.Sequential([
        keras.Input((6,)), layers.GaussianNoise(0.3),
        layers.Dense(12, activation="relu"), layers.Dropout(0.5),
        layers.Dense(2)])
    rng = _rng(12)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    return model, dict(optimizer="adam", loss="mse"), (x, y)


# -- a multi-input, multi-output functional model -----------------------------


def multi_io():
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    h = layers.Dense(6, activation="relu")(layers.Concatenate()([a, b]))
    out_a = layers.Dense(1, name="out_a")(h)
    out_b = layers.Dense(2, name="out_b")(h)
    model = keras.Model([a, b], [out_a, out_b])
    rng = _rng(13)
    x = [rng.normal(size=(ROWS, 3)).astype("float32"),
         rng.normal(size=(ROWS, 2)).astype("float32")]
    y = [rng.normal(size=(ROWS, 1)).astype("float32"),
         rng.normal(size=(ROWS, 2)).astype("float32") * 5]
    return model, dict(optimizer="adam", loss=["mse", "mae"],
                       loss_weights=[1.0, 0.5],
                       metrics=[["mae"], ["mse"]]), (x, y)


# -- tied weights: a decoder that reuses the encoder's kernel -----------------


class TiedAutoencoder(keras.Model):
    def __init__(self, hidden, **kwargs):
        super().__init__(**kwargs)
        self.encoder = layers.Dense(hidden, activation="tanh")
        self.bias = None

    def build(self, input_shape):
        self.encoder.build(input_shape)
        self.bias = self.add_weight(shape=(input_shape[-1],),
                                    initializer="zeros", name="out_bias")

    def call(self, x):
        h = self.encoder(x)
        return ops.matmul(h, ops.transpose(self.encoder.kernel)) + self.bias


def tied_weights():
    rng = _rng(14)
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    model = TiedAutoencoder(3)
    model.build((None, 5))
    return model, dict(optimizer="adam", loss="mse"), (x, x)


# -- overriding compute_metrics ----------------------------------------------


class OwnMetrics(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(2)
        self.max_error = keras.metrics.Mean(name="mean_abs_error")

    def call(self, x):
        return self.dense(x)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        self.max_error.update_state(ops.mean(ops.abs(y - y_pred)))
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        logs["mean_abs_error"] = self.max_error.result()
        return logs


def compute_metrics_override():
    rng = _rng(15)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    return OwnMetrics(), dict(optimizer="adam", loss="mse",
                              metrics=["mae"]), (x, y)


BUILT_IN = {
    "tied_weights": tied_weights,
    "compute_metrics_override": compute_metrics_override,
    "transformer": transformer,
    "no_config": no_config,
    "compute_loss_override": compute_loss_override,
    "test_step_override": test_step_override,
    "custom_objects": custom_objects,
    "sum_add_loss": sum_add_loss,
    "sum_loss": sum_loss,
    "noisy": noisy,
    "multi_io": multi_io,
}
OWN_STEP = {
    "gan": gan,
    "wgan_gp": wgan_gp,
    "wgan_gp_bn": wgan_gp_bn,
    "vae": vae,
    "guide_train_step": guide_train_step,
}
