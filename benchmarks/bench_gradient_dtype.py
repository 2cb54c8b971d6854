"""Reduced-precision gradient all-reduce: demo accuracy and bytes per step.

Runs `keras-mirror demo` (digits convnet, 4 logical CPU replicas) with
`gradient_dtype` float32, bfloat16 and float16, for several seeds each,
interleaved, one fresh process per run. Prints and writes (JSON and
Markdown under `benchmarks/results/`) the test accuracy of every run, the
mean and spread per dtype, and the bytes each replica sends into the
gradient all-reduce per step. A reduced dtype is "within run-to-run noise"
when its mean accuracy differs from float32's by less than float32's own
seed-to-seed spread (max - min).

Usage:

    python benchmarks/bench_gradient_dtype.py             # 3 seeds, ~5 min
    python benchmarks/bench_gradient_dtype.py --seeds 0,1 --epochs 5
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
DTYPES = ("float32", "bfloat16", "float16")


def _run(dtype, seed, epochs, timeout):
    cmd = [sys.executable, "-m", "keras_mirror.cli", "demo", "--seed",
           str(seed), "--gradient-dtype", dtype, "--epochs", str(epochs),
           "--target", "0"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    accuracy = re.search(r"Test accuracy ([0-9.]+)", done.stdout)
    loss = re.search(r"test loss ([0-9]+\.[0-9]+)", done.stdout)
    sent = re.search(r"gradient all-reduce: (\d+) bytes", done.stdout)
    if done.returncode != 0 or not accuracy or not sent or not loss:
        raise RuntimeError(f"demo failed ({dtype}, seed {seed}):\n"
                           + done.stdout[-2000:] + done.stderr[-2000:])
    return float(accuracy.group(1)), float(loss.group(1)), int(sent.group(1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {d: {} for d in DTYPES}
    losses = {d: {} for d in DTYPES}
    sent = {}
    for seed in seeds:
        for dtype in DTYPES:
            acc, loss, sent[dtype] = _run(dtype, seed, args.epochs,
                                          args.timeout)
            runs[dtype][seed] = acc
            losses[dtype][seed] = loss
            print(f"{dtype:>9} seed {seed}: accuracy {acc:.4f}, test loss "
                  f"{loss:.5f}, {sent[dtype]} bytes/step", flush=True)
    base = runs["float32"]
    noise = max(base.values()) - min(base.values())
    rows = []
    for dtype in DTYPES:
        accs = list(runs[dtype].values())
        mean = statistics.mean(accs)
        delta = mean - statistics.mean(base.values())
        rows.append({
            "gradient_dtype": dtype, "bytes_per_step": sent[dtype],
            "accuracy": runs[dtype], "test_loss": losses[dtype],
            "mean": mean,
            "min": min(accs), "max": max(accs),
            "delta_vs_float32": delta,
            "within_noise": abs(delta) <= noise,
        })
    lines = [
        "# bench_gradient_dtype results", "",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- Command: `python benchmarks/bench_gradient_dtype.py "
        f"{' '.join(argv or sys.argv[1:])}`".rstrip(),
        f"- `keras-mirror demo` (digits convnet, 4 logical CPUs, global "
        f"batch 100, {args.epochs} epochs), seeds {seeds}",
        f"- float32 seed-to-seed spread (the noise): {noise:.4f}", "",
        "| gradient dtype | bytes/replica/step | accuracy per seed | mean | "
        "mean - float32 | within noise | test loss per seed |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{a:.4f}" for a in r["accuracy"].values())
        per_loss = ", ".join(f"{v:.5f}" for v in r["test_loss"].values())
        lines.append(
            f"| {r['gradient_dtype']} | {r['bytes_per_step']} | {per_seed} | "
            f"{r['mean']:.4f} | {r['delta_vs_float32']:+.4f} | "
            f"{'yes' if r['within_noise'] else 'no'} | {per_loss} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out = args.out or os.path.join(_HERE, "results", "gradient_dtype")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"seeds": seeds, "epochs": args.epochs, "noise": noise,
                   "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(f"Wrote {out}.json and {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
