"""`keras-mirror demo`: a convnet on scikit-learn's digits over 4 replicas."""

import argparse
import os


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="keras-mirror demo",
        description="Train a small convnet on scikit-learn's bundled "
        "digits data across logical CPU replicas.")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=100,
                        help="global batch size (split across replicas)")
    parser.add_argument("--log-dir", default=None,
                        help="write per-replica TensorBoard runs here")
    parser.add_argument("--target", type=float, default=0.95,
                        help="test accuracy the demo must reach")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the shuffling")
    parser.add_argument("--gradient-dtype", default=None,
                        choices=("float32", "bfloat16", "float16"),
                        help="dtype of the gradient all-reduce (default: "
                        "the gradients' own, float32)")
    parser.add_argument("--execution", default="auto",
                        choices=("auto", "in_graph", "strategy"),
                        help="MirroredModel execution path (default auto)")
    return parser.parse_args(argv)


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


def replica_table(mirrored):
    """The end-of-fit per-replica summary, from `mirrored.replica_history`."""
    history = mirrored.replica_history
    samples = [sum(col) for col in zip(*history["samples"])]
    lines = [
        f"{'replica':>7}  {'device':<14} {'samples':>8} {'last loss':>10} "
        f"{'grad norm':>10} {'non-finite':>10} {'step ms':>8}"
    ]
    for r, device in enumerate(mirrored.devices):
        lines.append(
            f"{r:>7}  {device.split('device:')[-1]:<14} {int(samples[r]):>8} "
            f"{history['loss'][-1][r]:>10.4f} "
            f"{history['grad_norm'][-1][r]:>10.4f} "
            f"{int(sum(e[r] for e in history['nonfinite'])):>10} "
            f"{1000 * history['step_time'][-1][r]:>8.2f}")
    return "\n".join(lines)


def main(argv=None):
    """Runs the demo; returns 0 when the test accuracy reaches the target."""
    args = _parse(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import keras_mirror

    keras_mirror.logical_cpus(args.replicas)
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
    print("\nPer-replica summary (whole run; loss, grad norm and step "
          "time of the last epoch):")
    print(replica_table(mirrored))
    result = mirrored.evaluate(x_test, y_test, batch_size=b, verbose=0,
                               return_dict=True)
    accuracy = result["accuracy"]
    verdict = "reached" if accuracy >= args.target else "MISSED"
    print(f"\nTest accuracy {accuracy:.4f} on {len(x_test)} images "
          f"({verdict} the target {args.target:.2f}); test loss "
          f"{result['loss']:.5f}.")
    return 0 if accuracy >= args.target else 1
