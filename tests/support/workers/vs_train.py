"""A `MirroredModel` worker reading TFRecord files in virtual shards, for
tests/distribute/test_virtual_shards.py (one process, or started by
`keras_mirror.launch.launch`).

usage: vs_train.py DATA_DIR OUT_DIR [--epochs E] [--virtual-shards V]
                   [--input dataset|input_fn] [--backup DIR]
                   [--kill-at-step S --kill-worker I [--kill-always]]
                   [--sigterm-at-step S] [--repeat-steps N]

Trains `model()` with `worker_input="shard"` on the TFRecord files
`write_files` wrote in DATA_DIR (`list_files(shuffle=False)`, `interleave`,
a parsing `map` that also counts the records it parses, `batch(BATCH)`),
and writes `OUT_DIR/weights_<task index>.npz` (weights and `iterations`)
and `OUT_DIR/info_<task index>.json` (records parsed, workers, attempt).
With `--kill-at-step S` worker `--kill-worker` SIGKILLs itself after
step S (attempt 0, or every attempt with `--kill-always`); with
`--sigterm-at-step S` worker 1 sends itself SIGTERM (a preemption) after
step S on attempt 0.
"""

import argparse
import json
import os
import pathlib
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __name__ == "__main__":  # not when a test imports this module
    os.environ.setdefault("KERAS_MIRROR_CPUS_PER_WORKER", "1")
    import _lean  # noqa: F401  (beside this script: before Keras)

import keras_mirror  # noqa: E402

BATCH, FEATURES, TARGETS = 12, 6, 3
RECORDS = (7, 9, 6, 10, 8, 5, 9, 7, 6, 8, 11, 4)  # 90 records, 12 files


def write_files(data_dir):
    """Writes `len(RECORDS)` TFRecord files; returns the (x, y) per file."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(3)
    per_file = []
    for i, n in enumerate(RECORDS):
        x = rng.normal(size=(n, FEATURES)).astype("float32")
        y = rng.normal(size=(n, TARGETS)).astype("float32")
        path = os.path.join(data_dir, f"part-{i:02d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in range(n):
                features = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(
                        value=x[row])),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(
                        value=y[row]))}
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=features)).SerializeToString())
        per_file.append((x, y))
    return per_file


def parse(record):
    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([TARGETS], tf.float32)}
    example = tf.io.parse_single_example(record, spec)
    return example["x"], example["y"]


def model():
    import keras
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(TARGETS),
    ])


def optimizer():
    import keras
    return keras.optimizers.Adam(0.01)


def pipeline(data_dir, counter=None):
    """The user's one-device pipeline; `counter` counts parsed records."""
    import tensorflow as tf

    files = tf.data.Dataset.list_files(
        os.path.join(data_dir, "*.tfrecord"), shuffle=False)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=2,
                               deterministic=True)
    if counter is None:
        return records.map(parse).batch(BATCH)

    def counted(record):
        counter.assign_add(1)
        return parse(record)

    return records.map(counted).batch(BATCH)


def input_fn(data_dir, counter):
    """The same pipeline as TF users write for
    `distribute_datasets_from_function`."""
    import tensorflow as tf

    def fn(context):
        files = tf.data.Dataset.list_files(
            os.path.join(data_dir, "*.tfrecord"), shuffle=False)
        files = files.shard(context.num_input_pipelines,
                            context.input_pipeline_id)
        records = files.interleave(tf.data.TFRecordDataset, cycle_length=2,
                                   deterministic=True)

        def counted(record):
            counter.assign_add(1)
            return parse(record)

        return records.map(counted).batch(
            context.get_per_replica_batch_size(BATCH))

    return fn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--virtual-shards", type=int, default=6)
    parser.add_argument("--input", choices=("dataset", "input_fn"),
                        default="dataset")
    parser.add_argument("--backup")
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--kill-worker", type=int, default=1)
    parser.add_argument("--kill-always", action="store_true")
    parser.add_argument("--sigterm-at-step", type=int)
    parser.add_argument("--repeat-steps", type=int,
                        help="read the pipeline `.repeat()`ed, with this "
                        "`steps_per_epoch`")
    args = parser.parse_args()
    cpus = keras_mirror.logical_cpus(1)

    import keras
    import numpy as np
    import tensorflow as tf

    attempt = int(os.environ.get("KERAS_MIRROR_RESTART", "0"))
    mirrored = keras_mirror.MirroredModel(
        model(), devices=cpus, timeout_seconds=60, worker_input="shard",
        virtual_shards=args.virtual_shards)
    task = keras_mirror.cluster.cluster_from_env()
    index = 0 if task is None else task.task_index
    mirrored.compile(optimizer=optimizer(), loss="mse")
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    x = pipeline(args.data_dir, counter) if args.input == "dataset" else \
        input_fn(args.data_dir, counter)

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if args.kill_at_step is not None and (
                    attempt == 0 or args.kill_always) and \
                    step >= args.kill_at_step and index == args.kill_worker:
                print(f"killing myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.sigterm_at_step and attempt == 0 and \
                    index == 1:
                print(f"SIGTERM to myself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)

    callbacks = [Kill()]
    if args.backup:
        callbacks.insert(0, keras_mirror.StepBackup(args.backup))
    steps_per_epoch = None
    if args.repeat_steps:
        x, steps_per_epoch = x.repeat(), args.repeat_steps
    mirrored.fit(x, epochs=args.epochs, verbose=0, callbacks=callbacks,
                 steps_per_epoch=steps_per_epoch)
    out = pathlib.Path(args.out_dir)
    iterations = int(mirrored.optimizer.iterations.numpy())
    np.savez(out / f"weights_{index}.npz", *mirrored.model.get_weights(),
             iterations=iterations)
    (out / f"info_{index}.json").write_text(json.dumps({
        "attempt": attempt, "num_workers": mirrored.num_workers,
        "records_parsed": int(counter.numpy()), "iterations": iterations}))
    print(f"done: iterations={iterations}", flush=True)
    import _finish  # beside this script

    _finish.exit_together(out, index, mirrored.num_workers)


if __name__ == "__main__":
    sys.exit(main())
