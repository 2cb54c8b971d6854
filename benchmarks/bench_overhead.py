"""The cost of the wrapper itself: `MirroredModel` on one device vs `fit`.

Issue 5 asks for `MirroredModel` at N = 1 within 5% of plain Keras `fit`.
`bench_step.py` measures that across fresh processes, where the trial-to-trial
spread on a shared 2-core machine (up to 1.6x) is far larger than 5%. This
benchmark measures the same ratio paired, in one process:

- `single`: the model built and compiled under `tf.device(device)`, plain
  Keras `fit`;
- `mirrored`: the same architecture and initial weights wrapped by
  `keras_mirror.MirroredModel(model, devices=[device])` (the one
  `strategy` path), with every per-replica statistic on, as users get it;
- `nostats`: the same with `replica_stats=False`: the wrapper without the
  statistics, which plain `fit` does not compute either.

The models are traced first (one warm-up `fit` each). Then each repeat runs
one `fit` of `--steps` steps per variant, in an order that rotates from
repeat to repeat; a callback records every step's end, as in
`bench_step.py`. A repeat's value per variant is the median of its step
times, the ratios to `single` are taken within the repeat (paired), and the
report gives the median and the range of those ratios over repeats.

Usage:

    python benchmarks/bench_overhead.py            # full run
    python benchmarks/bench_overhead.py --quick    # smoke run, noisy numbers

Writes `benchmarks/results/overhead.json` and `.md` (or `--out PREFIX`).
"""

import argparse
import datetime
import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_DEFAULT_OUT = os.path.join(_HERE, "results", "overhead")
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import bench_report  # noqa: E402
import bench_step  # noqa: E402

VARIANTS = ("single", "mirrored", "nostats")
WRAPPED = VARIANTS[1:]
SCHEMA_VERSION = 2


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,convnet",
                        help="comma-separated, from mlp,convnet")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100,
                        help="steps per fit (default 100)")
    parser.add_argument("--repeats", type=int, default=40,
                        help="paired repeats per model (default 40)")
    parser.add_argument("--quick", action="store_true",
                        help="10 steps, 2 repeats: a smoke run")
    parser.add_argument("--out", default=_DEFAULT_OUT,
                        help="output path prefix (.json and .md are added)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 10, 2
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for model in args.models:
        if model not in bench_step.MODELS:
            parser.error(f"`--models` entries must be in {bench_step.MODELS}."
                         f" Received: models={args.models}")
    for name in ("batch_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name.replace('_', '-')}` must be >= 1. "
                         f"Received: {name}={getattr(args, name)}")
    return args


def _fit(model, variant, device, data, batch_size, timer):
    import tensorflow as tf

    x, y = data
    kwargs = dict(batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[timer] if timer is not None else None)
    if variant == "single":
        with tf.device(device):
            model.fit(x, y, **kwargs)
    else:
        model.fit(x, y, **kwargs)


def _measure(keras, tf, name, args, device):
    import keras_mirror

    shape = (64,) if name == "mlp" else (28, 28, 1)
    data = bench_step._make_data(shape, args.steps * args.batch_size)
    models = {}
    for variant in VARIANTS:
        keras.utils.set_random_seed(0)
        if variant == "single":
            with tf.device(device):
                model, _ = bench_step._build_model(keras, name)
                bench_step._compile(keras, model)
        else:
            model, _ = bench_step._build_model(keras, name)
            model = keras_mirror.MirroredModel(
                model, devices=[device],
                replica_stats=variant == "mirrored")
            bench_step._compile(keras, model)
        _fit(model, variant, device, data, args.batch_size, None)  # trace
        models[variant] = model
    trials = []
    for repeat in range(args.repeats):
        k = repeat % len(VARIANTS)
        order = VARIANTS[k:] + VARIANTS[:k]
        medians = {}
        for variant in order:
            timer = bench_step._make_timer(keras)
            _fit(models[variant], variant, device, data, args.batch_size,
                 timer)
            ends = timer.batch_ends
            steps_ms = [1e3 * (b - a) for a, b in zip(ends, ends[1:])]
            medians[variant] = statistics.median(steps_ms)
        ratios = {v: medians[v] / medians["single"] for v in WRAPPED}
        trials.append({"model": name, "repeat": repeat,
                       **{f"{v}_ms": medians[v] for v in VARIANTS},
                       "ratio": ratios["mirrored"],
                       "nostats_ratio": ratios["nostats"]})
        print(f"{name:>8} repeat {repeat:2d}: " + ", ".join(
            f"{v} {medians[v]:7.3f} ms" for v in VARIANTS) + "; ratios "
            + ", ".join(f"{v} {ratios[v]:.3f}" for v in WRAPPED),
            flush=True)
    return trials, models["mirrored"].execution


def run(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import keras
    import tensorflow as tf

    device = "/device:CPU:0"
    trials, rows = [], []
    load_before = bench_report.loadavg()
    for name in args.models:
        model_trials, execution = _measure(keras, tf, name, args, device)
        trials += model_trials
        row = {"model": name, "execution": execution}
        for v in VARIANTS:
            row[f"{v}_ms"] = statistics.median(
                t[f"{v}_ms"] for t in model_trials)
        for key in ("ratio", "nostats_ratio"):
            ratios = [t[key] for t in model_trials]
            row[f"{key}_median"] = statistics.median(ratios)
            row[f"{key}_min"] = min(ratios)
            row[f"{key}_max"] = max(ratios)
        rows.append(row)
    return {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "bench_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "machine": bench_report.describe_machine(tf, keras, []),
        "settings": {
            "device": device,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "repeats": args.repeats,
            "quick": args.quick,
            "models": args.models,
        },
        "load_average": {"before": load_before,
                         "after": bench_report.loadavg()},
        "results": rows,
        "trials": trials,
        "notes": [
            "ratio = MirroredModel ms/step / single-device fit ms/step, "
            "paired within each repeat; the table gives the median and "
            "range over repeats.",
            "MirroredModel: the default, every per-replica statistic "
            "computed; replica_stats=False: none, as plain fit.",
        ],
    }


def markdown(report):
    s = report["settings"]
    m = report["machine"]
    lines = [
        "# bench_overhead: MirroredModel on one device vs plain `fit`",
        "",
        f"{report['date']}; {m.get('cpu_model')}, "
        f"{m.get('logical_cores')} logical cores; TensorFlow "
        f"{m.get('tensorflow')}, Keras {m.get('keras')}; commit "
        f"{m.get('git_commit')}.",
        f"Device {s['device']}, global batch {s['batch_size']}, "
        f"{s['steps']} steps per fit, {s['repeats']} paired repeats. "
        f"Load average before/after: {report['load_average']['before']} / "
        f"{report['load_average']['after']}.",
        "",
        "| model | path | single ms/step | MirroredModel ms/step | "
        "ratio (median) | ratio range | replica_stats=False ms/step | "
        "ratio (median) | ratio range |",
        "|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['model']} | {r['execution']} | {r['single_ms']:.3f} | "
            f"{r['mirrored_ms']:.3f} | {r['ratio_median']:.3f} | "
            f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f} | "
            f"{r['nostats_ms']:.3f} | {r['nostats_ratio_median']:.3f} | "
            f"{r['nostats_ratio_min']:.3f}-{r['nostats_ratio_max']:.3f} |")
    lines += ["", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def main(argv=None):
    args = _parse(argv)
    report = run(args)
    bench_report.write(report, args.out, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
