"""A `MirroredModel` worker for tests/distribute/test_multi_worker.py and
tests/callbacks/test_step_backup.py (started by `keras_mirror.launch.launch`).

usage: mw_train.py OUT_DIR [--epochs E[,E...]] [--backup DIR]
                   [--kill-at-step S] [--local-cpus N]
                   [--model KIND[,KIND...]]

Trains `model(kind)` on `data(kind)` (45 rows, global batch 8, no
shuffling; `embedding` has sparse `IndexedSlices` gradients, which the
workers all-gather instead of summing) and
writes `OUT_DIR/weights_<task index>.npz` (the final weights, plus
`iterations`) and `OUT_DIR/info_<task index>.json`. Several kinds
(`--model dense,conv --epochs 2,1`) train one after another in the same
process (one start-up, one strategy), each into `OUT_DIR/<kind>/`. With
`--kill-at-step S` the worker SIGKILLs itself after global step S, on
launcher attempt 0 only (`KERAS_MIRROR_RESTART`), or on every attempt with
`--kill-always` (once past step S), when its task index is `--kill-worker`
(default 1). With `--sigterm-at-step S`, worker 1 sends itself SIGTERM (a
preemption) after step S on attempt 0; with `--sigterm-in build` while
`fit` builds the model, with `--sigterm-in end` at the last epoch's end.
"""

import argparse
import json
import os
import pathlib
import signal
import sys
import time

START = time.monotonic()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __name__ == "__main__":  # not when a test imports model() and data()
    # `import keras_mirror` sets a worker up with this many logical CPUs.
    os.environ["KERAS_MIRROR_CPUS_PER_WORKER"] = sys.argv[
        sys.argv.index("--local-cpus") + 1] \
        if "--local-cpus" in sys.argv else "2"
    import _lean  # noqa: F401  (beside this script: before Keras)

import keras_mirror  # noqa: E402

ROWS, BATCH = 45, 8


KINDS = ("dense", "embedding", "conv")
# "conv": 42 rows, so the last global batch (2 rows) leaves worker 1's two
# replicas empty: they run stand-in rows through a convolution.
CONV_ROWS = 42
VOCAB, TOKENS = 20, 5


def model(kind="dense"):
    import keras
    keras.utils.set_random_seed(0)
    if kind == "conv":
        return keras.Sequential([
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, strides=2, padding="same"),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ])
    if kind == "embedding":
        return keras.Sequential([
            keras.Input((TOKENS,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ])
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])


def optimizer():
    import keras
    return keras.optimizers.Adam(0.01)


def data(kind="dense"):
    import numpy as np
    rng = np.random.default_rng(1)
    if kind == "conv":
        x = rng.normal(size=(CONV_ROWS, 6, 6, 2)).astype("float32")
        return x, rng.normal(size=(CONV_ROWS, 3)).astype("float32")
    if kind == "embedding":
        # Few distinct tokens: replicas and workers share rows of the table.
        x = rng.integers(0, VOCAB, size=(ROWS, TOKENS)).astype("int32")
    else:
        x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", default="2")
    parser.add_argument("--backup")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--sigterm-at-step", type=int)
    parser.add_argument("--sigterm-in", choices=("build", "end"),
                        help="worker 1 sends itself SIGTERM (attempt 0) "
                        "while fit builds the model, or at the last "
                        "epoch's end (after the step backup's)")
    parser.add_argument("--worker-input", default="replicate")
    parser.add_argument("--backup-every", type=int, default=1)
    parser.add_argument("--kill-worker", type=int, default=1)
    parser.add_argument("--kill-always", action="store_true")
    parser.add_argument("--local-cpus", type=int, default=2)
    parser.add_argument("--model", default="dense")
    args = parser.parse_args()
    cpus = keras_mirror.logical_cpus(args.local_cpus)
    kinds = args.model.split(",")
    epochs = [int(e) for e in args.epochs.split(",")]
    epochs = epochs * len(kinds) if len(epochs) == 1 else epochs
    assert set(kinds) <= set(KINDS) and len(epochs) == len(kinds), args
    out = pathlib.Path(args.out_dir)
    for kind, kind_epochs in zip(kinds, epochs):
        # Several models, one after another on the process's one strategy:
        # each writes into OUT_DIR/<kind>/.
        kind_out = out if len(kinds) == 1 else out / kind
        kind_out.mkdir(exist_ok=True)
        train(args, cpus, kind, kind_epochs, kind_out)
    task = keras_mirror.cluster.cluster_from_env()
    if task is not None:
        import _finish  # beside this script

        _finish.exit_together(out, task.task_index, task.num_workers)


def train(args, cpus, kind, epochs, out):
    """Trains `model(kind)` for `epochs`; writes its weights and info."""
    import keras
    import numpy as np

    attempt = int(os.environ.get("KERAS_MIRROR_RESTART", "0"))
    mirrored = keras_mirror.MirroredModel(model(kind), devices=cpus,
                                          timeout_seconds=60,
                                          worker_input=args.worker_input)
    task = keras_mirror.cluster.cluster_from_env()
    index = 0 if task is None else task.task_index
    mirrored.compile(optimizer=optimizer(), loss="mse")
    built = time.monotonic() - START
    times = {}

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            times.setdefault("first_step", time.monotonic() - START)
            first = attempt == 0 or args.kill_always
            if args.kill_at_step is not None and first and \
                    step >= args.kill_at_step and index == args.kill_worker:
                print(f"killing myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if args.sigterm_at_step is not None and attempt == 0 and \
                    step == args.sigterm_at_step and index == 1:
                print(f"SIGTERM to myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)

        def on_epoch_end(self, epoch, logs=None):
            if args.sigterm_in == "end" and attempt == 0 and index == 1 \
                    and epoch == epochs - 1:
                print("SIGTERM to myself at the last epoch's end",
                      flush=True)
                os.kill(os.getpid(), signal.SIGTERM)

    if args.sigterm_in == "build" and attempt == 0 and index == 1:
        from keras_mirror.wrapper import _compile

        ensure_built = _compile.ensure_built

        def signalled_while_building(*a, **k):
            print("SIGTERM to myself while fit builds", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return ensure_built(*a, **k)

        _compile.ensure_built = signalled_while_building

    callbacks = []
    if args.backup:
        from keras_mirror.callbacks.step_backup import StepBackup
        callbacks.append(StepBackup(args.backup,
                                    every_n_steps=args.backup_every))
    callbacks.append(Probe())
    x, y = data(kind)
    history = mirrored.fit(x, y, batch_size=BATCH, epochs=epochs,
                           shuffle=False, verbose=0, callbacks=callbacks)
    weights = mirrored.model.get_weights()
    iterations = int(mirrored.optimizer.iterations.numpy())
    np.savez(out / f"weights_{index}.npz", *weights, iterations=iterations)
    # The per-replica vectors stay out of History (plain Keras's keys).
    replica_samples = mirrored.replica_history.get("samples")
    info = {
        "attempt": attempt,
        "is_chief": mirrored.is_chief,
        "num_workers": mirrored.num_workers,
        "num_replicas": mirrored.num_replicas,
        "local_replica_ids": list(mirrored.local_replica_ids),
        "multi_worker": mirrored._multi_worker,
        "iterations": iterations,
        "seconds_to_build": built,
        "seconds_to_first_step": times.get("first_step"),
        "replica_history": {k: np.asarray(v).tolist() for k, v in
                            mirrored.replica_history.items()},
        "loss": history.history.get("loss"),
        "replica_samples": replica_samples and np.asarray(
            replica_samples).tolist(),
    }
    (out / f"info_{index}.json").write_text(json.dumps(info, default=str))
    mirrored.save_weights(out / "final.weights.h5")
    print(f"done: iterations={iterations}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
