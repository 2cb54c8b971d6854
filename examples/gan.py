"""A small DCGAN on scikit-learn's 8x8 digits, on 4 replicas, exactly.

The model is the keras.io DCGAN pattern, written as one would for one
device: sub-models passed to `__init__`, its own `compile(d_optimizer=...,
g_optimizer=..., loss_fn=...)` and a `train_step` that draws its latent
vectors with `keras.random.normal(..., seed=self.seed_generator)`. It is
wrapped as the instance it is, unchanged, by `keras_mirror.MirroredModel`:
each replica runs the step on its shard, draws its rows of what one device
would draw, and every optimizer's gradients are weighted by the shard's
share of the global batch before the all-reduce, so the run equals
single-device training.

    python examples/gan.py --epochs 30
    tensorboard --logdir runs/gan   # d_loss / g_loss per replica

Writes `gan_samples.png`, a grid of generated digits.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mirror  # noqa: E402

LATENT = 16


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per epoch (default: the whole data)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--d-steps", type=int, default=2,
                        help="discriminator steps per generator step")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--logdir", default="runs/gan")
    parser.add_argument("--out", default="gan_samples.png")
    return parser.parse_args(argv)


def build_gan(keras, tf, d_steps):
    class GAN(keras.Model):
        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def latent(self, rows):
            return keras.random.normal((rows, LATENT),
                                       seed=self.seed_generator)

        def train_step(self, real):
            rows = keras.ops.shape(real)[0]
            labels = tf.concat([tf.ones((rows, 1)), tf.zeros((rows, 1))], 0)
            d_vars = self.discriminator.trainable_weights
            for _ in range(d_steps):
                with tf.GradientTape() as tape:
                    fake = self.generator(self.latent(rows))
                    pred = self.discriminator(tf.concat([fake, real], 0))
                    d_loss = self.loss_fn(labels, pred)
                grads = tape.gradient(d_loss, d_vars)
                self.d_optimizer.apply_gradients(zip(grads, d_vars))
            g_vars = self.generator.trainable_weights
            with tf.GradientTape() as tape:
                pred = self.discriminator(self.generator(self.latent(rows)))
                g_loss = self.loss_fn(tf.zeros((rows, 1)), pred)
            grads = tape.gradient(g_loss, g_vars)
            self.g_optimizer.apply_gradients(zip(grads, g_vars))
            return {"d_loss": d_loss, "g_loss": g_loss}

    def make():
        layers = keras.layers
        discriminator = keras.Sequential([
            keras.Input((8, 8, 1)),
            layers.Conv2D(16, 3, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2D(32, 3, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Flatten(),
            layers.Dense(1),
        ], name="discriminator")
        generator = keras.Sequential([
            keras.Input((LATENT,)),
            layers.Dense(2 * 2 * 64),
            layers.LeakyReLU(0.2),
            layers.Reshape((2, 2, 64)),
            layers.Conv2DTranspose(32, 4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2D(1, 3, padding="same", activation="tanh"),
        ], name="generator")
        return GAN(discriminator, generator)

    return make


def dataset(tf, images, batch_size):
    """Batches of real images (the latent noise is drawn in the step)."""
    ds = tf.data.Dataset.from_tensor_slices(images).shuffle(
        len(images), seed=0)
    return ds.batch(batch_size).prefetch(2)


def save_grid(generator, path, np, rows=6):
    noise = np.random.default_rng(0).normal(size=(rows * rows, LATENT))
    images = generator.predict(noise.astype("float32"), verbose=0)
    images = ((images[..., 0] + 1.0) * 127.5).clip(0, 255).astype("uint8")
    grid = images.reshape(rows, rows, 8, 8).transpose(0, 2, 1, 3)
    grid = grid.reshape(rows * 8, rows * 8)
    from PIL import Image

    Image.fromarray(grid).resize((rows * 8 * 6, rows * 8 * 6),
                                 Image.NEAREST).save(path)


def main(argv=None):
    args = parse_args(argv)
    devices = keras_mirror.logical_cpus(args.replicas)
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    images = load_digits().images.astype("float32")
    images = (images / 8.0 - 1.0)[..., None]  # pixel values 0..16 -> -1..1
    model = build_gan(keras, tf, args.d_steps)()
    gan = keras_mirror.MirroredModel(model, devices=devices)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(1e-4, beta_1=0.5),
        g_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    callbacks = []
    board = getattr(keras_mirror, "ReplicaTensorBoard", None)
    if board is not None:
        callbacks.append(board(args.logdir))
    history = gan.fit(dataset(tf, images, args.batch_size),
                      epochs=args.epochs, steps_per_epoch=args.steps,
                      callbacks=callbacks, verbose=2)
    last = {k: v[-1] for k, v in history.history.items()}
    print(f"final d_loss {last['d_loss']:.4f}, g_loss {last['g_loss']:.4f}")
    per_replica = gan.replica_history.get("d_loss", [[]])[-1]
    print("per-replica d_loss (last epoch):",
          " ".join(f"{v:.4f}" for v in per_replica))
    save_grid(model.generator, args.out, np)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
