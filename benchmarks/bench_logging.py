"""Step-time cost of `ReplicaTensorBoard`.

Trains one `MirroredModel` (an MLP, synthetic data) with `fit` in three
configurations and compares their time per step:

- `none`: no `ReplicaTensorBoard` (MirroredModel's own `ReplicaHistory` still
  gathers the per-replica vectors, as it always does);
- `batch`: `ReplicaTensorBoard(update_freq="batch")`, writing every step;
- `every_100`: `ReplicaTensorBoard(update_freq=100)`;
- `keras_batch`: Keras's own `keras.callbacks.TensorBoard(update_freq=
  "batch", write_graph=False)` on the same model: the anchor.

The cost per scalar written is each mode's extra time per step over `none`
(paired within a repeat) divided by the scalars it writes per step, counted
by reading its event files back with TensorBoard's reader.

All configurations run in one process on the same model, after one warm-up
`fit` that traces the step, so tracing is not measured. Trials are
interleaved: each repeat runs every configuration once, in an order rotated
from repeat to repeat, and ratios are taken within a repeat (paired) before
the median over repeats, so that slow phases of a shared machine cancel out.
A trial's time is the wall time of its whole `fit` divided by its steps, so
writer creation, flushes and closing count too.

Usage:

    python benchmarks/bench_logging.py            # full run
    python benchmarks/bench_logging.py --quick    # smoke run, noisy numbers

Writes `benchmarks/results/logging.json` and `.md` (or `--out PREFIX`).
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_DEFAULT_OUT = os.path.join(_HERE, "results", "logging")

MODES = ("none", "batch", "every_100", "keras_batch")
_UPDATE_FREQ = {"batch": "batch", "every_100": 100, "keras_batch": "batch"}
SCHEMA_VERSION = 2


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4,
                        help="logical CPU replicas (default 4)")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="global batch size (default 256)")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps per trial (default 200)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved repeats (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="20 steps, 2 repeats: a smoke run")
    parser.add_argument("--out", default=_DEFAULT_OUT,
                        help="output path prefix (.json and .md are added)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 20, 2
    for name in ("replicas", "batch_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be >= 1. "
                         f"Received: {name}={getattr(args, name)}")
    return args


def _setup(replicas):
    """Splits the CPU, then imports Keras.

    Returns:
        `(keras, keras_mirror, ReplicaTensorBoard)`.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import keras_mirror

    keras_mirror.logical_cpus(replicas)
    import keras

    from keras_mirror.callbacks import ReplicaTensorBoard

    return keras, keras_mirror, ReplicaTensorBoard


def _model(keras, keras_mirror):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return mirrored


def _data(rows):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype("float32")
    y = rng.integers(0, 10, size=(rows,)).astype("int32")
    return x, y


def _trial(mirrored, callback_class, mode, data, args, log_root):
    """Seconds per step of one `fit` of `args.steps` steps in `mode`."""
    callbacks = []
    log_dir = os.path.join(log_root, f"{mode}_{time.monotonic_ns()}")
    if mode == "keras_batch":
        import keras

        callbacks.append(keras.callbacks.TensorBoard(
            log_dir, update_freq="batch", write_graph=False))
    elif mode != "none":
        callbacks.append(callback_class(
            log_dir, update_freq=_UPDATE_FREQ[mode]))
    x, y = data
    start = time.perf_counter()
    mirrored.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0,
                 shuffle=False, callbacks=callbacks)
    elapsed = time.perf_counter() - start
    scalars = _count_scalars(log_dir)
    shutil.rmtree(log_dir, ignore_errors=True)
    return elapsed / args.steps, scalars


def _count_scalars(log_dir):
    """Scalar values written under `log_dir`, read back by TensorBoard."""
    from tensorboard.backend.event_processing import event_accumulator

    total = 0
    for root, _, files in os.walk(log_dir):
        if not any(".tfevents." in f for f in files):
            continue
        acc = event_accumulator.EventAccumulator(
            root, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            events = acc.Tensors(tag)
            if events and not events[0].tensor_proto.string_val:
                total += len(events)
    return total


def run(args):
    keras, keras_mirror, callback_class = _setup(args.replicas)
    mirrored = _model(keras, keras_mirror)
    data = _data(args.steps * args.batch_size)
    trials = []
    with tempfile.TemporaryDirectory(prefix="bench_logging_") as log_root:
        _trial(mirrored, callback_class, "batch", data, args, log_root)
        for repeat in range(args.repeats):
            shift = repeat % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                seconds, scalars = _trial(mirrored, callback_class, mode,
                                          data, args, log_root)
                trials.append({"repeat": repeat, "mode": mode,
                               "step_ms": seconds * 1e3,
                               "scalars_per_step": scalars / args.steps})
                print(f"repeat {repeat} {mode:>9}: "
                      f"{seconds * 1e3:8.3f} ms/step", flush=True)
    return _report(args, keras, trials)


def _report(args, keras, trials):
    import tensorflow as tf

    by_mode = {m: [t["step_ms"] for t in trials if t["mode"] == m]
               for m in MODES}
    per_repeat = {}
    for t in trials:
        per_repeat.setdefault(t["repeat"], {})[t["mode"]] = t["step_ms"]
    results = [{
        "mode": m,
        "update_freq": _UPDATE_FREQ.get(m),
        "median_step_ms": statistics.median(v),
        "min_step_ms": min(v),
        "max_step_ms": max(v),
        "scalars_per_step": statistics.median(
            t["scalars_per_step"] for t in trials if t["mode"] == m),
    } for m, v in by_mode.items()]
    for row in results:
        extra = statistics.median(
            r[row["mode"]] - r["none"] for r in per_repeat.values())
        row["extra_ms_per_step"] = extra
        row["us_per_scalar"] = (1e3 * extra / row["scalars_per_step"]
                                if row["scalars_per_step"] else None)
    ratios = {
        f"{m}_over_none": statistics.median(
            r[m] / r["none"] for r in per_repeat.values())
        for m in MODES if m != "none"
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "bench_logging",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(),
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
        },
        "settings": {
            "model": "mlp 64-256-256-10",
            "replicas": args.replicas,
            "devices": "logical CPUs",
            "batch_size": args.batch_size,
            "steps": args.steps,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "results": results,
        "ratios": ratios,
        "trials": trials,
        "notes": [
            "Ratios are medians over repeats of within-repeat ratios.",
            "batch / every_100: ReplicaTensorBoard; keras_batch: Keras's "
            "TensorBoard(update_freq='batch', write_graph=False), the "
            "anchor. us/scalar = (mode - none, paired, median over "
            "repeats) / scalars written per step (epoch-end ones "
            "included), counted from the event files.",
            "A trial is one fit; its time includes writer set-up and close "
            "and one tf.function trace per layout of tags (a fixed cost "
            "per fit, about 0.5 s on 2 shared cores, spread over --steps).",
        ],
    }


def _per_scalar(us):
    if us is None:
        return "-"
    # A mode cheaper than `none` is within the noise: no cost to divide.
    return format(us, ".1f") if us > 0 else "<= 0 (noise)"


def _markdown(report):
    s = report["settings"]
    lines = [
        "# bench_logging",
        "",
        f"{s['model']}, {s['replicas']} replicas on {s['devices']}, global "
        f"batch {s['batch_size']}, {s['steps']} steps per trial, "
        f"{s['repeats']} interleaved repeats. TensorFlow "
        f"{report['machine']['tensorflow']}, Keras "
        f"{report['machine']['keras']}, {report['machine']['logical_cores']}"
        f" logical cores; {report['date']}.",
        "",
        "| mode | update_freq | median ms/step | min | max | vs none | "
        "scalars/step | extra ms/step | us/scalar |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        ratio = report["ratios"].get(f"{row['mode']}_over_none", 1.0)
        freq = "-" if row["update_freq"] is None else str(row["update_freq"])
        per = row["us_per_scalar"]
        lines.append(
            f"| {row['mode']} | {freq} | {row['median_step_ms']:.3f} | "
            f"{row['min_step_ms']:.3f} | {row['max_step_ms']:.3f} | "
            f"{ratio:.3f} | {row['scalars_per_step']:.2f} | "
            f"{row['extra_ms_per_step']:.3f} | "
            f"{_per_scalar(per)} |")
    lines += ["", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def main(argv=None):
    args = _parse(argv)
    report = run(args)
    text = _markdown(report)
    print()
    print(text)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
