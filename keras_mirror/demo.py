"""`keras-mirror demo`: a convnet on scikit-learn's digits over CPU replicas.

Checks its dependencies before importing TensorFlow (a 10 s start), so that
a missing scikit-learn gets one line saying what to install, and hides
TensorFlow's native start-up lines that a CPU machine cannot act on
(`_quiet`).
"""

import argparse
import importlib.metadata
import importlib.util
import os
import sys

HELP = "train a small convnet on scikit-learn's digits over CPU replicas"
DESCRIPTION = (
    "Train a small convnet on scikit-learn's bundled digits data (no "
    "download) across logical CPU replicas; print the split plan, Keras's "
    "progress bar and a per-replica table, and check the test accuracy "
    "against --target (exit code 1 below it).")
INSTALL_DEMO = 'pip install "keras-mirror[demo]"'
# Distributions that install the `tensorflow` package besides `tensorflow`.
TF_FLAVOURS = ("tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
               "tensorflow-cpu-aws", "tensorflow-macos", "intel-tensorflow",
               "tf-nightly", "tf-nightly-cpu")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}")
    return value


def _int(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer, got {text!r}") from None


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"must be a number from 0 to 1, got {text!r}")
    return value


def add_arguments(parser):
    """Adds the demo's options, each help saying its default."""
    parser.add_argument(
        "--replicas", type=_positive_int, default=4, metavar="N",
        help="logical CPU replicas (default: %(default)s)")
    parser.add_argument(
        "--epochs", type=_positive_int, default=20, metavar="N",
        help="epochs to train (default: %(default)s)")
    parser.add_argument(
        "--batch-size", type=_positive_int, default=100, metavar="B",
        help="global batch size, split across the replicas "
        "(default: %(default)s)")
    parser.add_argument(
        "--log-dir", default=None, metavar="DIR",
        help="write one TensorBoard run per replica here (default: none)")
    parser.add_argument(
        "--target", type=_fraction, default=0.95, metavar="ACC",
        help="test accuracy the demo must reach (default: %(default)s)")
    parser.add_argument(
        "--seed", type=_int, default=0,
        help="seed of the weights and the shuffling (default: %(default)s)")
    parser.add_argument(
        "--gradient-dtype", default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the gradient all-reduce (default: the gradients' "
        "own, float32)")
    parser.add_argument(
        "--execution", default="auto",
        choices=("auto", "strategy"),
        help="MirroredModel execution path (default: %(default)s)")
    return parser


def _installed(distribution):
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_requirements():
    """What to install before the demo can run, as a message; or None.

    Reads only package metadata: no TensorFlow import. `keras-mirror[demo]`
    brings `tensorflow`; where another flavour (`tensorflow-cpu`, ...)
    provides TensorFlow already, the message names scikit-learn alone, so
    that following it never installs a second TensorFlow.
    """
    missing = [name for module, name in (("tensorflow", "TensorFlow"),
                                         ("sklearn", "scikit-learn"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    other_flavour = not _installed("tensorflow") and any(
        _installed(name) for name in TF_FLAVOURS)
    command = ('pip install "scikit-learn>=1.3"' if other_flavour
               else INSTALL_DEMO)
    return (f"keras-mirror demo needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed. "
            f"Install with:\n\n    {command}\n")


def main(argv=None):
    """Parses `argv` and runs the demo; returns the exit code."""
    parser = argparse.ArgumentParser(prog="keras-mirror demo",
                                     description=DESCRIPTION)
    return run(add_arguments(parser).parse_args(argv))


def _data():
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    return train_test_split(x, y, test_size=0.2, random_state=0,
                            stratify=y) + [np]


def _model(keras):
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ], name="digits_convnet")


REPLICA_TITLE = "Per-replica summary (samples: whole run; others: last epoch)"
REPLICA_HEADER = ["replica", "device", "samples", "loss", "grad norm",
                  "non-finite", "ms/step"]


def replica_rows(mirrored):
    """The end-of-fit per-replica table's rows, from `replica_history`."""
    history = mirrored.replica_history
    samples = [sum(col) for col in zip(*history["samples"])]
    return [[str(r), device.split("device:")[-1], str(int(samples[r])),
             f"{history['loss'][-1][r]:.4f}",
             f"{history['grad_norm'][-1][r]:.4f}",
             str(int(sum(e[r] for e in history["nonfinite"]))),
             f"{1000 * history['step_time'][-1][r]:.2f}"]
            for r, device in enumerate(mirrored.devices)]


def _start(replicas):
    """Imports TensorFlow and splits the CPU, hiding native start-up noise."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_mirror.launch import _quiet

    with _quiet.native_stderr():
        import keras
        import tensorflow as tf

        import keras_mirror

        keras_mirror.logical_cpus(replicas)
        tf.config.list_logical_devices()  # initialise the devices here
    return keras, keras_mirror


def run(args):
    """Runs the demo; returns 0 when the test accuracy reaches the target."""
    problem = missing_requirements()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    keras, keras_mirror = _start(args.replicas)
    from keras_mirror.wrapper import _rendering

    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test, _ = _data()
    mirrored = keras_mirror.MirroredModel(
        _model(keras), gradient_dtype=args.gradient_dtype,
        execution=args.execution)
    mirrored.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    mirrored.summary()
    b = args.batch_size
    steps = -(-len(x_train) // b)
    last = len(x_train) - (steps - 1) * b
    print(f"\n{len(x_train)} training images, global batch {b}: {steps} "
          f"steps per epoch.")
    print(f"split plan for a global batch of {b}: {mirrored.split_plan(b)}")
    print(f"split plan for the last batch of {last}: "
          f"{mirrored.split_plan(last)}")
    print(f"gradient all-reduce: {mirrored.allreduce_bytes_per_step} bytes "
          f"per replica per step ({args.gradient_dtype or 'float32'})\n")
    callbacks = []
    if args.log_dir:
        callbacks.append(keras_mirror.ReplicaTensorBoard(args.log_dir))
    mirrored.fit(x_train, y_train, batch_size=b, epochs=args.epochs,
                 callbacks=callbacks, verbose=1)
    print()
    _rendering.table(
        REPLICA_TITLE, REPLICA_HEADER, replica_rows(mirrored),
        justify=["right", "left"] + ["right"] * 5)
    result = mirrored.evaluate(x_test, y_test, batch_size=b, verbose=0,
                               return_dict=True)
    accuracy = result["accuracy"]
    verdict = "reached" if accuracy >= args.target else "MISSED"
    print(f"\nTest accuracy {accuracy:.4f} on {len(x_test)} images "
          f"({verdict} the target {args.target:.2f}); test loss "
          f"{result['loss']:.5f}.")
    return 0 if accuracy >= args.target else 1
