"""Draws the performance page's figures from the benchmarks' JSON results.

Reads `benchmarks/results/` (the newest `bench_step-*.json`, and
`network.json`) and writes PNGs into `docs/img/`:

- `scaling.png`: median ms/step against the number of replicas, per
  variant, one panel per model, the trials' range as error bars;
- `first_step.png`: seconds to the first step (trace, compile and the step)
  per variant and number of replicas;
- `network.png`: ms/step of 2 workers on emulated hosts, per link rate.

    python benchmarks/plot_results.py [--results DIR] [--out DIR]

The figures are regenerated from the JSON alone (no benchmark runs); the
PNGs are written without a timestamp, so that the same results and the
same matplotlib give the same files.
"""

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

# bench_step's variants, in the order and with the names of its tables.
VARIANTS = {
    "single": "one device (plain fit)",
    "native": "native Keras + MirroredStrategy",
    "mirrored": "MirroredModel",
}
# One colour per variant in every panel, whichever variants a model has.
COLORS = {"single": "tab:gray", "native": "tab:blue", "mirrored": "tab:orange"}
# bench_network's step variants.
NETWORK_VARIANTS = {
    "native": "native Keras",
    "mirror": "MirroredModel fp32",
    "mirror_bucket": "MirroredModel, 1 MiB buckets",
    "mirror_bf16": "MirroredModel, bf16 buckets",
}
FIGURES = ("scaling.png", "first_step.png", "network.png")


def newest_bench_step(results_dir):
    """The newest `bench_step-*.json` result (by its recorded date)."""
    paths = glob.glob(os.path.join(results_dir, "bench_step-*.json"))
    if not paths:
        raise FileNotFoundError(
            f"`--results` must hold a bench_step-*.json result. "
            f"Received: results={results_dir!r}")
    runs = [(json.load(open(p)), p) for p in paths]
    return max(runs, key=lambda run: run[0]["date"])


def _rows(run, model, variant):
    rows = [r for r in run["results"]
            if r["model"] == model and r["variant"] == variant
            and r["trials_ok"]]
    return sorted(rows, key=lambda r: r["replicas"])


def _caption(fig, run, name):
    load = " ".join(f"{x:.2f}" for x in run.get("loadavg_before", []))
    machine = run["machine"]
    fig.text(0.01, 0.01,
             f"{name}, {run['date'][:10]}, {machine['cpu_model']} "
             f"({machine['physical_cores']} cores), "
             f"load average before: {load}",
             fontsize=7, color="0.4")


def _save(fig, path):
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def plot_scaling(run, path):
    models = run["settings"]["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    for ax, model in zip(list(getattr(axes, "flat", [axes])), models):
        for variant, label in VARIANTS.items():
            rows = _rows(run, model, variant)
            if not rows:
                continue
            if variant == "single":
                ax.axhline(rows[0]["median_step_ms"], color="0.3",
                           linestyle="--", label=label)
                continue
            n = [r["replicas"] for r in rows]
            med = [r["median_step_ms"] for r in rows]
            err = [[m - r["min_trial_step_ms"] for m, r in zip(med, rows)],
                   [r["max_trial_step_ms"] - m for m, r in zip(med, rows)]]
            ax.errorbar(n, med, yerr=err, marker="o", capsize=3, label=label,
                        color=COLORS[variant])
        ax.set_title(f"{model}, global batch "
                     f"{run['settings']['batch_size']}")
        ax.set_xlabel("replicas N")
        ax.set_xticks(sorted({r["replicas"] for r in run["results"]}))
        ax.set_ylabel("median ms/step (lower is better)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes_list = list(getattr(axes, "flat", [axes]))
    axes_list[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _caption(fig, run, "bench_step.py")
    _save(fig, path)


def plot_first_step(run, path):
    models = run["settings"]["models"]
    replicas = sorted({r["replicas"] for r in run["results"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    width = 0.8 / len(VARIANTS)
    for ax, model in zip(list(getattr(axes, "flat", [axes])), models):
        for i, (variant, label) in enumerate(VARIANTS.items()):
            rows = {r["replicas"]: r for r in _rows(run, model, variant)}
            xs = [j + (i - (len(VARIANTS) - 1) / 2) * width
                  for j, n in enumerate(replicas) if n in rows]
            ys = [rows[n]["first_step_s"] for n in replicas if n in rows]
            ax.bar(xs, ys, width, label=label, color=COLORS[variant])
        ax.set_xticks(range(len(replicas)), [f"N = {n}" for n in replicas])
        ax.set_title(f"{model}: time to the first step")
        ax.set_ylabel("seconds (trace, compile, first step)")
        ax.grid(axis="y", alpha=0.3)
    list(getattr(axes, "flat", [axes]))[0].legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _caption(fig, run, "bench_step.py")
    _save(fig, path)


def plot_network(run, path):
    rows = [r for r in run["rows"] if r["workers"] == 2]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    width = 0.8 / (len(NETWORK_VARIANTS) + 1)
    for ax, model in zip(list(getattr(axes, "flat", [axes])), models):
        mine = [r for r in rows if r["model"] == model]
        rates = [r["rate"] for r in mine]
        series = {"comm_fp32": "gradient all-reduce alone (fp32)",
                  **NETWORK_VARIANTS}
        for i, (key, label) in enumerate(series.items()):
            xs = [j + (i - len(NETWORK_VARIANTS) / 2) * width
                  for j in range(len(mine))]
            ax.bar(xs, [r[key] for r in mine], width, label=label,
                   hatch="//" if key == "comm_fp32" else None)
        ax.set_xticks(range(len(rates)), rates)
        ax.set_title(f"{model}, 2 workers, batch {mine[0]['batch']}")
        ax.set_xlabel("link rate (tc tbf)")
        ax.set_ylabel("ms/step (lower is better)")
        ax.grid(axis="y", alpha=0.3)
    list(getattr(axes, "flat", [axes]))[0].legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _caption(fig, run, "bench_network.py")
    _save(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=os.path.join(_HERE, "results"))
    parser.add_argument("--out", default=os.path.join(_ROOT, "docs", "img"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run, source = newest_bench_step(args.results)
    plot_scaling(run, os.path.join(args.out, "scaling.png"))
    plot_first_step(run, os.path.join(args.out, "first_step.png"))
    with open(os.path.join(args.results, "network.json")) as f:
        plot_network(json.load(f), os.path.join(args.out, "network.png"))
    for name in FIGURES:
        print(os.path.join(args.out, name))
    print(f"from {os.path.basename(source)} and network.json")


if __name__ == "__main__":
    main()
