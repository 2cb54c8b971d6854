"""Custom losses under `MirroredModel`: a `Loss` subclass and a function.

keras-mirror weights each replica's loss by its share of the global batch,
which is exact when the loss returns one value per example and is reduced
by Keras (`sum_over_batch_size`, the default). This script trains the same
model with a `keras.losses.Loss` subclass and with a plain function, on 4
replicas and on one device, and prints how far the weights are apart.

    python examples/custom_loss.py --epochs 3
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mirror  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--rows", type=int, default=503,
                        help="training rows (503 leaves an uneven batch)")
    parser.add_argument("--replicas", type=int, default=4)
    return parser.parse_args(argv)


def make_losses(keras):
    ops = keras.ops

    class SmoothedCrossentropy(keras.losses.Loss):
        """Label-smoothed sparse cross-entropy, one value per example."""

        def __init__(self, smoothing=0.1, name="smoothed_crossentropy"):
            super().__init__(name=name)
            self.smoothing = smoothing

        def call(self, y_true, y_pred):
            classes = ops.shape(y_pred)[-1]
            onehot = ops.one_hot(ops.reshape(y_true, (-1,)), classes)
            soft = onehot * (1.0 - self.smoothing) + self.smoothing / classes
            return keras.losses.categorical_crossentropy(
                soft, y_pred, from_logits=True)

        def get_config(self):
            return {"smoothing": self.smoothing, "name": self.name}

    def hinge_margin(y_true, y_pred):
        """A function loss: multiclass hinge, one value per example."""
        onehot = ops.one_hot(ops.reshape(y_true, (-1,)),
                             ops.shape(y_pred)[-1])
        true_score = ops.sum(y_pred * onehot, axis=-1)
        other = ops.max(y_pred - 1e9 * onehot, axis=-1)
        return ops.relu(1.0 + other - true_score)

    return {"Loss subclass": SmoothedCrossentropy(0.1),
            "function": hinge_margin}


def main(argv=None):
    args = parse_args(argv)
    devices = keras_mirror.logical_cpus(args.replicas)
    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data[:args.rows] / 16.0).astype("float32")
    y = digits.target[:args.rows].astype("int32")

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ])

    worst = 0.0
    for label, loss in make_losses(keras).items():
        reference = make_model()
        reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
        reference.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                      shuffle=False, verbose=0)
        mirrored = keras_mirror.MirroredModel(make_model(), devices=devices)
        mirrored.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
        history = mirrored.fit(x, y, batch_size=args.batch_size,
                               epochs=args.epochs, shuffle=False, verbose=0)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
            reference.get_weights(), mirrored.model.get_weights()))
        worst = max(worst, diff)
        print(f"{label}: final loss {history.history['loss'][-1]:.4f}, "
              f"max weight difference to one device {diff:.2e}")
    print(f"max weight difference {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
