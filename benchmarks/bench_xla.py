"""XLA per replica: MirroredModel(jit) against one device(jit), side by side.

One process with 4 logical CPUs. Every configuration (one device or
`MirroredModel` over the first N logical CPUs, `jit_compile` on or off)
gets its own copy of the model, built, compiled and traced once (the first
`fit` is timed as "first fit", trace and XLA compilation included); then
rounds of `fit` over `--steps` steps run every configuration once per round,
in an order rotated from round to round, and the medians of the rounds'
ms/step are reported with the ratios the issue asks for:

- MirroredModel(jit) / one device(jit) at N = 1, 2, 4;
- MirroredModel jit / no jit at the same N.

Usage:

    python benchmarks/bench_xla.py [--models mlp convnet] [--rounds 7]
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path[:0] = [_ROOT, _HERE]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_report  # noqa: E402
import bench_step  # noqa: E402
import keras  # noqa: E402

import keras_mirror  # noqa: E402

CPUS = keras_mirror.logical_cpus(4)


def _configs(replicas):
    out = [("one device", 0, True), ("one device", 0, False)]
    for n in replicas:
        out += [("MirroredModel", n, True), ("MirroredModel", n, False)]
    return out


def _name(kind, n, jit):
    return f"{kind}{'' if not n else f' N={n}'} jit={jit}"


def _trainer(model_name, kind, n, jit, execution):
    keras.utils.set_random_seed(0)
    model, shape = bench_step._build_model(keras, model_name)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit)
    if kind == "MirroredModel":
        return keras_mirror.MirroredModel(
            model, devices=list(CPUS[:n]), execution=execution,
            replica_stats=False), shape
    return model, shape


def _time_fit(trainer, x, y, batch, steps):
    start = time.perf_counter()
    trainer.fit(x[:batch * steps], y[:batch * steps], batch_size=batch,
                epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - start


def run(args):
    results = {}
    for model_name in args.models:
        configs = _configs(args.replicas)
        trainers, first = {}, {}
        x = y = None
        for cfg in configs:
            trainer, shape = _trainer(model_name, *cfg, args.execution)
            if x is None:
                x, y = bench_step._make_data(shape, args.batch * args.steps)
            first[cfg] = _time_fit(trainer, x, y, args.batch, 1)
            _time_fit(trainer, x, y, args.batch, args.steps)  # warm-up
            trainers[cfg] = trainer
        times = {cfg: [] for cfg in configs}
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for cfg in order:
                times[cfg].append(1e3 * _time_fit(
                    trainers[cfg], x, y, args.batch, args.steps) / args.steps)
        med = {cfg: statistics.median(t) for cfg, t in times.items()}
        rows = [{"config": _name(*cfg), "ms_per_step": med[cfg],
                 "first_fit_s": first[cfg]} for cfg in configs]
        ratios = {}
        for n in args.replicas:
            ratios[f"MirroredModel(jit) / one device(jit), N={n}"] = (
                med[("MirroredModel", n, True)] / med[("one device", 0, True)])
            ratios[f"MirroredModel jit / no jit, N={n}"] = (
                med[("MirroredModel", n, True)]
                / med[("MirroredModel", n, False)])
        ratios["one device jit / no jit"] = (
            med[("one device", 0, True)] / med[("one device", 0, False)])
        results[model_name] = {"rows": rows, "ratios": ratios}
    return results


def markdown(results, meta):
    lines = ["# XLA per replica (bench_xla.py)", "",
             f"`{meta['command']}` on {meta['date']} at commit "
             f"{meta['commit']}, 4 logical CPUs of the shared 2-core VM, "
             f"execution={meta['execution']!r}, load average before "
             f"{meta['load_before']}, after {meta['load_after']}. Medians of "
             f"{meta['rounds']} interleaved rounds of {meta['steps']} steps, "
             f"global batch {meta['batch']}. 'first fit' is the first "
             "one-step `fit` of each configuration in this process (trace "
             "and XLA compilation), not a fresh process.", ""]
    for model_name, res in results.items():
        lines += [f"## {model_name}", "", "```",
                  f"{'configuration':34s} {'ms/step':>9s} {'first fit s':>12s}"]
        lines += [f"{r['config']:34s} {r['ms_per_step']:9.2f} "
                  f"{r['first_fit_s']:12.2f}" for r in res["rows"]]
        lines += ["", f"{'ratio':44s} {'value':>6s}"]
        lines += [f"{k:44s} {v:6.2f}" for k, v in res["ratios"].items()]
        lines += ["```", ""]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "convnet"])
    parser.add_argument("--replicas", nargs="+", type=int,
                        default=[1, 2, 4])
    parser.add_argument("--execution", default="strategy",
                        choices=["strategy"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(_HERE, "results"))
    args = parser.parse_args()
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    results = run(args)
    meta = {
        "command": "python benchmarks/bench_xla.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"),
        "commit": bench_report.git_commit(), "execution": args.execution,
        "load_before": load_before,
        "load_after": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "rounds": args.rounds, "steps": args.steps, "batch": args.batch,
    }
    text = markdown(results, meta)
    print(text)
    stem = os.path.join(args.out, f"xla_{args.execution}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
