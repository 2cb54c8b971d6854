"""Bytes on the link and records read with `worker_input="shard"`, before/after.

Writes `--files` TFRecord files of raw 32x32x3 uint8 images and labels; 2
workers, each in its own network namespace (`netns.py`, links shaped to
`--rate`), train a small convnet (`MirroredModel(...,
worker_input="shard", virtual_shards=V)`, 1 logical CPU each, an
accuracy metric) for 2 epochs on the usual pipeline (`list_files`,
`interleave` of `TFRecordDataset`, a `map` that counts the records it
parses, `batch(B)`). Each worker reads its `eth0` byte counters (sysfs of
its namespace) at every batch end and measures an idle baseline (3 s after
`fit`, nothing running), and reports:

- bytes received and sent per training step (median of epoch 2's steps,
  and epoch 2's total over its steps, the end-of-data check included),
  less the idle baseline over the step's time; against the gradient bytes
  (4 x parameters x the ring's 2(W-1)/W), the global batch's bytes (the
  float32 rows the model takes, and the labels) and the other worker's
  rows (what an all-gather of the batch brings each worker);
- records parsed during `fit` (the counting `map`) against its share
  (records in the files of its virtual shards) x 2 epochs.

Runs the package at each `--before` revision (default a3bc55f, the batch
all-gathered, and 750ca58, also a counting pass; a temporary
`git worktree` under /tmp, removed at the end) and the working tree's
("after"), each with `PYTHONPATH` pointing at it. Writes
`benchmarks/results/shard_traffic.{json,md}`. Needs root (namespaces);
without it, says so and exits 0.

Usage:

    python benchmarks/bench_shard_traffic.py            # ~5 min
    python benchmarks/bench_shard_traffic.py --quick    # after only, ~1 min
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import net_cluster  # noqa: E402

SIZE, CLASSES, WORKERS = 32, 10, 2
ROW_BYTES = SIZE * SIZE * 3 * 4 + 8  # float32 image + int64 label


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="the working tree only, 8 files x 16 records")
    p.add_argument("--before", default="a3bc55f,750ca58",
                   help="revisions measured as 'before', comma-separated: "
                   "a3bc55f all-gathers the batch; 750ca58 also counts "
                   "each share once before training")
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--virtual-shards", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.before, args.records = "", 16
    args.before = [r for r in args.before.split(",") if r]
    args.out = args.out or os.path.join(
        _HERE, "results", "shard_traffic-quick" if args.quick
        else "shard_traffic")
    return args


def write_files(data_dir, files, records):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for i in range(files):
        with tf.io.TFRecordWriter(
                os.path.join(data_dir, f"part-{i:03d}.tfrecord")) as w:
            for _ in range(records):
                image = rng.integers(0, 255, (SIZE, SIZE, 3), np.uint8)
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[image.tobytes()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(
                        value=[int(rng.integers(CLASSES))]))})
                ).SerializeToString())


def build():
    """32x32x3 -> Conv(16, s2) -> Conv(32, s2) -> pool -> Dense(10):
    5.4 k parameters (21.7 KB), one row 12.3 KB."""
    import keras

    keras.utils.set_random_seed(1234)
    L = keras.layers
    return keras.Sequential([
        keras.Input((SIZE, SIZE, 3)),
        L.Conv2D(16, 3, strides=2, activation="relu"),
        L.Conv2D(32, 3, strides=2, activation="relu"),
        L.GlobalAveragePooling2D(), L.Dense(CLASSES)])


def worker(args):
    import keras_mirror

    cpus = keras_mirror.logical_cpus(1)
    import keras
    import tensorflow as tf

    counter = tf.Variable(0, dtype=tf.int64, trainable=False)

    def parse_record(record):
        counter.assign_add(1)
        ex = tf.io.parse_single_example(record, {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)})
        image = tf.reshape(tf.io.decode_raw(ex["image"], tf.uint8),
                           (SIZE, SIZE, 3))
        return tf.cast(image, tf.float32) / 255.0, ex["label"]

    files = tf.data.Dataset.list_files(
        os.path.join(args.data_dir, "*.tfrecord"), shuffle=False)
    ds = files.interleave(tf.data.TFRecordDataset, cycle_length=2).map(
        parse_record).batch(args.batch)
    model = build()
    mirrored = keras_mirror.MirroredModel(
        model, devices=cpus, worker_input="shard",
        virtual_shards=args.virtual_shards)
    mirrored.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"])
    meter = net_cluster.Meter()
    mirrored.fit(ds, epochs=2, verbose=0, callbacks=[meter])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    idle = net_cluster.idle(3.0)
    out = {"worker": index, "package": os.path.dirname(keras_mirror.__file__),
           "params": model.count_params(),
           "records_in_fit": int(counter.numpy()),
           "readings": meter.readings, "idle_bytes_per_s": idle}
    with open(f"{args.worker}.{index}.json", "w") as f:
        json.dump(out, f)
    return 0


def share(args, index):
    """Records in worker `index`'s virtual shards (contiguous blocks of
    `balanced_sizes(V, W)`; shard v reads files v, v + V, ...)."""
    v = args.virtual_shards
    sizes = [v // WORKERS + (w < v % WORKERS) for w in range(WORKERS)]
    mine = range(sum(sizes[:index]), sum(sizes[:index + 1]))
    return args.records * sum(1 for f in range(args.files) if f % v in mine)


def summarise(args, label, revision, out, index):
    steps = net_cluster.per_step(out["readings"], epoch=1)
    n, rx, tx = net_cluster.epoch_totals(out["readings"], 1)
    ms = statistics.median(s[0] for s in steps)
    idle_rx, idle_tx = out["idle_bytes_per_s"]
    params = out["params"]
    ring = 2 * (WORKERS - 1) / WORKERS
    rows = args.batch
    return {
        "label": label, "revision": revision, "worker": index,
        "package": out["package"], "params": params,
        "steps_epoch2": n, "step_ms": ms,
        "idle_rx_per_s": idle_rx, "idle_tx_per_s": idle_tx,
        "rx_per_step": statistics.median(s[1] for s in steps)
        - idle_rx * ms / 1000,
        "tx_per_step": statistics.median(s[2] for s in steps)
        - idle_tx * ms / 1000,
        "rx_per_step_epoch": (rx - idle_rx * ms / 1000 * n) / n,
        "tx_per_step_epoch": (tx - idle_tx * ms / 1000 * n) / n,
        "gradient_bytes": 4 * params * ring,
        "global_batch_bytes": rows * ROW_BYTES,
        "other_rows_bytes": rows * ROW_BYTES * (WORKERS - 1) / WORKERS,
        "records_in_fit": out["records_in_fit"],
        "share_2_epochs": 2 * share(args, index),
        "steps": [list(s) for s in steps],
    }


def measure(args, net, roots, data_dir, tmp, log):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    rows, port = [], 24400
    for label, revision, root in roots:
        port += 1
        print(f"{label} ({revision}): {WORKERS} workers over {args.rate} ...",
              flush=True)
        out = os.path.join(tmp, f"{label}")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", out,
                "--data-dir", data_dir, "--batch", str(args.batch),
                "--virtual-shards", str(args.virtual_shards)]
        try:
            net_cluster.run(net, lambda i: argv,
                            dict(env, PYTHONPATH=root), port, args.timeout,
                            log)
        except RuntimeError as e:
            print(net_cluster.log_tail(log), file=sys.stderr)
            raise SystemExit(f"{label} failed: {e}")
        for i in range(WORKERS):
            with open(f"{out}.{i}.json") as f:
                rows.append(summarise(args, label, revision, json.load(f), i))
    return rows


def _k(b):
    return f"{b / 1000:.1f}"


def markdown(report):
    s, m = report["settings"], report["machine"]
    lines = [
        "# bench_shard_traffic: worker_input='shard' bytes and records", "",
        f"- Date: {report['date']}; command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['logical_cores']} logical cores; "
        f"TensorFlow {m['tensorflow']}, Keras {m['keras']}; load average "
        f"before/after {report['loadavg_before']} / "
        f"{report['loadavg_after']}",
        f"- {WORKERS} workers x 1 CPU replica, each in its own network "
        f"namespace, veth links to a bridge shaped to {s['rate']} (`tc "
        f"tbf`); {s['files']} TFRecord files x {s['records']} records of "
        f"32x32x3 uint8 images, `virtual_shards={s['virtual_shards']}`, "
        f"global batch {s['batch']}, 2 epochs; convnet of "
        f"{report['rows'][0]['params']} parameters.",
        "- KB are 1000 bytes at the link layer (sysfs `rx_bytes`/`tx_bytes` "
        "of the worker's `eth0`: TCP/IP and gRPC framing included), less "
        "the idle baseline over the step's time. rx/step: median of epoch "
        "2's steps; epoch: epoch 2's total (its end-of-data check included) "
        "/ its steps.", "",
        "| code | worker | rx KB/step | tx KB/step | rx KB/step (epoch) | "
        "idle B/s | gradients KB (x ring) | global batch KB | other "
        "worker's rows KB | rx / gradients | records read in fit | share "
        "x 2 epochs | read / share |",
        "|---|---:|" + "---:|" * 11]
    for r in report["rows"]:
        lines.append(
            f"| {r['label']} ({r['revision']}) | {r['worker']} | "
            f"{_k(r['rx_per_step'])} | {_k(r['tx_per_step'])} | "
            f"{_k(r['rx_per_step_epoch'])} | {r['idle_rx_per_s']:.0f} | "
            f"{_k(r['gradient_bytes'])} | {_k(r['global_batch_bytes'])} | "
            f"{_k(r['other_rows_bytes'])} | "
            f"{r['rx_per_step'] / r['gradient_bytes']:.2f} | "
            f"{r['records_in_fit']} | {r['share_2_epochs']} | "
            f"{r['records_in_fit'] / r['share_2_epochs']:.2f} |")
    lines += ["", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def _worktree(revision, path):
    subprocess.run(["git", "-C", _ROOT, "worktree", "add", "--detach",
                    path, revision], check=True, capture_output=True,
                   timeout=60)


def _remove_worktree(path):
    subprocess.run(["git", "-C", _ROOT, "worktree", "remove", "--force",
                    path], capture_output=True, timeout=60)


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    import netns

    reason = netns.unavailable()
    if reason:
        print(f"bench_shard_traffic: skipped: {reason}. It runs workers in "
              "network namespaces and needs root.")
        return 0
    import bench_report

    start, load_before = time.monotonic(), bench_report.loadavg()
    roots, made = [], []
    try:
        for rev in args.before:
            path = f"/tmp/before-{rev}"
            _worktree(rev, path)
            made.append(path)
            roots.append(("before", rev, path))
        roots.append(("after", bench_report.git_commit(), _ROOT))
        with tempfile.TemporaryDirectory() as tmp, \
                open(os.path.join(tmp, "workers.log"), "w") as log:
            data_dir = os.path.join(tmp, "data")
            os.makedirs(data_dir)
            write_files(data_dir, args.files, args.records)
            with netns.Network(WORKERS, rate=args.rate) as net:
                rows = measure(args, net, roots, data_dir, tmp, log)
    finally:
        for path in made:
            _remove_worktree(path)
    import keras
    import tensorflow as tf

    report = {
        "benchmark": "bench_shard_traffic",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "command": "python benchmarks/bench_shard_traffic.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bench_report.describe_machine(tf, keras, []),
        "settings": {k: getattr(args, k) for k in (
            "quick", "before", "files", "records", "virtual_shards",
            "batch", "rate")},
        "loadavg_before": load_before, "loadavg_after": bench_report.loadavg(),
        "seconds": round(time.monotonic() - start, 1), "rows": rows,
        "notes": [
            "gradients: 4 bytes x parameters x 2(W-1)/W, what a ring "
            "all-reduce sends and receives per worker (W = 2: the model's "
            "bytes once).",
            "global batch: the float32 images and int64 labels of the "
            "global batch as the model takes them; other worker's rows: "
            "what all-gathering the batch brings each worker.",
            "share: records in the files of the worker's virtual shards; "
            "read once per epoch, the 2 epochs read it twice.",
            "a3bc55f: the step all-gathers every worker's rows (the "
            "counting pass was already gone, 16ca363); 750ca58: the parent "
            "of 16ca363, with the counting pass; after: each replica "
            "trains on its own rows (4f48c0a) and gathers each step the "
            "row counts, the targets and the predictions, and each "
            "replica's first row (the stand-in for an empty replica) only "
            "in a step that leaves a replica empty."]}
    bench_report.write(report, args.out, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
