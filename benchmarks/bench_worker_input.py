"""Input between workers: `worker_input="replicate"` vs `"shard"` (tf.data).

Writes `--files` TFRecord files of PNG-encoded 64x64x3 images; the input
pipeline is the usual one (`list_files(shuffle=False)`, `interleave` of
`TFRecordDataset`, a `map` that does real work: `decode_png`, `resize` to
32x32, four 3x3 convolutions of the image, standardise, `batch`), and a
small Dense model trains 2 epochs on it. For W = 2 and 3 workers on
127.0.0.1 (`keras_mirror.launch.launch`), each with
`worker_input="replicate"` (every worker reads and maps every record) and
`"shard"` with `virtual_shards=--virtual-shards` (each worker reads its
virtual shards' files), it prints per worker: records parsed (a counting
`map`), bytes of the files it read, bytes the process read (`rchar` of
`/proc/self/io` during `fit`), the input time (one pass over the
worker's input alone, before training) and the median step time of the
second epoch; then `shard/replicate` ratios side by side. One process with
the same `virtual_shards` is run too (the single-device reference): its
weights and every worker's must agree within 1e-5.

Writes `benchmarks/results/worker_input.md` and `.json`. The machine has
2 shared cores: W workers share them, so the step times are the cluster's
contention as much as the input's; the records and bytes are exact.

Usage:

    python benchmarks/bench_worker_input.py            # ~4 min
    python benchmarks/bench_worker_input.py --quick    # ~2 min, fewer files
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SIZE, OUT_SIZE, BATCH, CLASSES = 64, 32, 48, 10


def _rchar():
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f
                            if line.startswith("rchar")).split()[1])
    except (OSError, StopIteration):
        return -1


def write_files(data_dir, files, records):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for i in range(files):
        with tf.io.TFRecordWriter(
                os.path.join(data_dir, f"part-{i:03d}.tfrecord")) as w:
            for _ in range(records):
                image = rng.integers(0, 255, (SIZE, SIZE, 3), np.uint8)
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[tf.io.encode_png(image).numpy()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[int(rng.integers(CLASSES))]))}
                w.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())


def pipeline(data_dir, counter):
    import tensorflow as tf

    kernel = tf.random.stateless_normal((3, 3, 3, 3), seed=(1, 2))

    def parse(record):
        counter.assign_add(1)
        example = tf.io.parse_single_example(record, {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        image = tf.io.decode_png(example["image"], channels=3)
        image = tf.image.resize(tf.cast(image, tf.float32) / 255.0,
                                (OUT_SIZE, OUT_SIZE))
        for _ in range(4):  # real work per record
            image = tf.nn.conv2d(image[None], kernel, 1, "SAME")[0]
        image = tf.image.per_image_standardization(image)
        return tf.reshape(image, [-1]), example["label"]

    files = tf.data.Dataset.list_files(
        os.path.join(data_dir, "*.tfrecord"), shuffle=False)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=2)
    return records.map(parse).batch(BATCH)


def worker(args):
    import keras_mirror

    cpus = keras_mirror.logical_cpus(1)
    import keras
    import tensorflow as tf

    from keras_mirror.distribute import _virtual_shards

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((OUT_SIZE * OUT_SIZE * 3,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(CLASSES)])
    shard = args.mode == "shard"
    mirrored = keras_mirror.MirroredModel(
        model, devices=cpus, worker_input=args.mode,
        virtual_shards=args.virtual_shards if shard else None)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.
                     SparseCategoricalCrossentropy(from_logits=True))
    counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    x = pipeline(args.data_dir, counter)
    # Input alone: the shard mode's counting pass, then one pass over
    # what this worker reads per epoch.
    start = time.perf_counter()
    stream = _virtual_shards.fit_dataset(mirrored, x) if shard else x
    count_s = time.perf_counter() - start
    counted = int(counter.numpy())
    start = time.perf_counter()
    for _ in stream:
        pass
    input_s = time.perf_counter() - start
    per_epoch = int(counter.numpy()) - counted
    times = []

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._epoch, self._t = epoch, time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if self._epoch == 1:  # the second epoch: no tracing
                times.append(time.perf_counter() - self._t)
            self._t = time.perf_counter()

    counter.assign(0)
    rchar = _rchar()
    mirrored.fit(x, epochs=2, verbose=0, callbacks=[Steps()])
    rchar = _rchar() - rchar
    task = keras_mirror.cluster.cluster_from_env()
    index = 0 if task is None else task.task_index
    files = sorted(tf.io.gfile.glob(os.path.join(args.data_dir, "*")))
    mine = files
    if shard:
        workers = mirrored.num_workers
        mine = _virtual_shards.file_shares(
            files, args.virtual_shards,
            _virtual_shards.hosted(args.virtual_shards, workers, index))
    result = {
        "worker": index, "records_per_epoch": per_epoch,
        "records_in_fit": int(counter.numpy()),
        "file_bytes": sum(os.path.getsize(f) for f in mine),
        "rchar_in_fit": rchar, "input_s": input_s, "count_s": count_s,
        "step_ms": 1000 * statistics.median(times) if times else None,
        "weights": [w.tolist() for w in mirrored.model.get_weights()],
    }
    with open(os.path.join(args.out, f"{args.tag}_{index}.json"), "w") as f:
        json.dump(result, f)


def run(args, mode, workers, data_dir, out):
    from keras_mirror import launch as launch_lib

    tag = f"{mode}-w{workers}"
    command = [sys.executable, os.path.abspath(__file__), "--worker",
               "--mode", mode, "--data-dir", data_dir, "--out", out,
               "--tag", tag, "--virtual-shards", str(args.virtual_shards)]
    if workers == 1:
        os.environ["KERAS_MIRROR_CPUS_PER_WORKER"] = "1"
        code = os.spawnv(os.P_WAIT, sys.executable, command)
    else:
        code = launch_lib.launch(command, workers, timeout=600,
                                 start_timeout=180, grace_period=2)
    if code != 0:
        raise SystemExit(f"{tag} failed with exit code {code}")
    return [json.load(open(os.path.join(out, f"{tag}_{w}.json")))
            for w in range(workers)]


def _gap(a, b):
    import numpy as np

    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
               for u, v in zip(a, b))


def report(args, results, total_bytes):
    reference = results[("shard", 1)][0]["weights"]
    rows, ratios = [], []
    for (mode, workers), per_worker in sorted(results.items()):
        for r in per_worker:
            gap = f"{_gap(r['weights'], reference):.1e}" \
                if mode == "shard" else "-"
            rows.append(
                f"| {mode} | {workers} | {r['worker']} | "
                f"{r['records_per_epoch']} | {r['records_in_fit']} | "
                f"{r['file_bytes'] / 1e6:.2f} | {r['rchar_in_fit'] / 1e6:.2f}"
                f" | {r['count_s']:.2f} | {r['input_s']:.2f} | "
                f"{r['step_ms']:.1f} | {gap} |")
    for workers in (2, 3):
        rep, sh = results[("replicate", workers)], results[("shard", workers)]

        def mean(key, group):
            return statistics.mean(r[key] for r in group)

        records = mean("records_per_epoch", sh) / mean(
            "records_per_epoch", rep)
        ratios.append(
            f"| {workers} | {records:.2f}"
            f" | {mean('file_bytes', sh) / mean('file_bytes', rep):.2f} | "
            f"{mean('rchar_in_fit', sh) / mean('rchar_in_fit', rep):.2f} | "
            f"{mean('input_s', sh) / mean('input_s', rep):.2f} | "
            f"{mean('step_ms', sh) / mean('step_ms', rep):.2f} |")
    lines = [
        "# bench_worker_input: replicate vs shard (virtual shards)", "",
        f"{args.files} TFRecord files x {args.records} PNG records "
        f"({total_bytes / 1e6:.2f} MB), batch {BATCH}, "
        f"virtual_shards={args.virtual_shards}, 2 epochs, 1 logical CPU "
        "per worker, workers on 127.0.0.1 sharing this machine's cores "
        f"(load before: {os.getloadavg()[0]:.1f}).", "",
        "Per worker: records parsed in one epoch (counting `map`) and in "
        "`fit` (2 epochs, plus the shard mode's one counting pass), bytes "
        "of the files it reads, bytes the process read during `fit` "
        "(`rchar`), the shard mode's counting pass (count s; it includes "
        "the workers' exchange of counts), one pass over its input alone "
        "(input s), median step of epoch 2, and max |w - w_ref| against "
        "one process with the same virtual shards (replicate trains on the "
        "pipeline's own batches: no reference).", "",
        "| mode | W | worker | records/epoch | records in fit | file MB | "
        "rchar MB | count s | input s | step ms | vs ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "Ratios shard / replicate (mean over workers):", "",
        "| W | records | file bytes | rchar | input time | step time |",
        "|---|---|---|---|---|---|", *ratios, ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", default="shard")
    parser.add_argument("--data-dir")
    parser.add_argument("--out")
    parser.add_argument("--tag")
    parser.add_argument("--virtual-shards", type=int, default=6)
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--records", type=int, default=60)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results",
                        default=os.path.join(_HERE, "results", "worker_input"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.files, args.records = 12, 24
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, out = os.path.join(tmp, "data"), os.path.join(tmp, "out")
        os.makedirs(data_dir)
        os.makedirs(out)
        write_files(data_dir, args.files, args.records)
        total = sum(os.path.getsize(os.path.join(data_dir, f))
                    for f in os.listdir(data_dir))
        results = {("shard", 1): run(args, "shard", 1, data_dir, out)}
        for workers in (2, 3):
            for mode in ("replicate", "shard"):
                results[(mode, workers)] = run(args, mode, workers,
                                               data_dir, out)
    text = report(args, results, total)
    print(text)
    with open(args.results + ".md", "w") as f:
        f.write(text)
    with open(args.results + ".json", "w") as f:
        json.dump({f"{m}-w{w}": [{k: v for k, v in r.items()
                                  if k != "weights"} for r in rs]
                   for (m, w), rs in results.items()}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
