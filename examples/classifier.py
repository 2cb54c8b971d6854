"""A plain classifier on scikit-learn's 8x8 digits, with `MirroredModel`.

Any compiled Keras model trains on 4 logical CPU replicas (or all GPUs)
without entering a strategy scope; the last, uneven global batch is split
exactly, and `mirrored.model` is the plain trained model.

    python examples/classifier.py --epochs 20
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mirror  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=4)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    devices = keras_mirror.logical_cpus(args.replicas)
    import keras
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    mirrored = keras_mirror.MirroredModel(model, devices=devices)
    print("split of the last batch:",
          mirrored.split_plan(len(x_train) % args.batch_size))
    mirrored.fit(x_train, y_train, batch_size=args.batch_size,
                 epochs=args.epochs, verbose=2)
    loss, accuracy = mirrored.evaluate(x_test, y_test, verbose=0)
    print(f"test loss {loss:.4f}, test accuracy {accuracy:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
