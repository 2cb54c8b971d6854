"""Random numbers per replica per step, step time and peak RSS: the Dropout
MLP at N = 4, counter-offset draws against the old gather of global rows.

A 256-2048-2048-10 MLP with `Dropout(0.5)` after each hidden layer, global
batch 256 on 4 logical CPUs (`execution="strategy"`). "before" is the code
of a git ref (default `main`, exported with `git archive`), which drew each
shard-shaped draw for the whole global batch and gathered the replica's
rows; "after" is this checkout. Each measurement runs in a fresh process:

- draws: the elements each executed random op output in one step, read
  from TF's debugger dump of the step as it ran
  (`tests/support/random_ops.py`), divided by the 4 replicas;
- ms/step: median over `--steps` steps after one warm-up epoch;
- peak RSS: `ru_maxrss` of the timing process.

Usage:

    python benchmarks/bench_random.py [--before-ref main] [--trials 2]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
N, BATCH, WIDTH = 4, 256, 2048


def _fit_args():
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10)])
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(BATCH, 256)).astype("float32"), \
        rng.normal(size=(BATCH, 10)).astype("float32")


def _helper():
    """`tests/support/random_ops.py` of this checkout (not the before's)."""
    import importlib.util

    path = os.path.join(_ROOT, "tests", "support", "random_ops.py")
    spec = importlib.util.spec_from_file_location("random_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trial(measure, steps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_mirror

    keras_mirror.logical_cpus(N)
    import numpy as np

    model, x, y = _fit_args()
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    if measure == "draws":
        sizes = _helper().random_draw_sizes(lambda: mirrored.fit(
            x, y, batch_size=BATCH, epochs=1, verbose=0))
        return {"draws_per_replica": sum(s for _, s in sizes) / N,
                "random_ops": len(sizes)}
    mirrored.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    xs, ys = np.tile(x, (steps, 1)), np.tile(y, (steps, 1))
    times = []

    class Clock(__import__("keras").callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    mirrored.fit(xs, ys, batch_size=BATCH, epochs=1, shuffle=False,
                 verbose=0, callbacks=[Clock()])
    return {"ms_per_step": 1000 * statistics.median(times),
            "peak_rss_mb": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run(code, measure, steps):
    env = dict(os.environ, PYTHONPATH=code,
               PYTHONDONTWRITEBYTECODE="1", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, __file__, "--trial", measure, "--steps",
         str(steps)], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _export(ref):
    where = tempfile.mkdtemp(prefix="km_before_")
    archive = subprocess.run(["git", "-C", _ROOT, "archive", ref],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    return where


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before-ref", default="main")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trial")
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(_trial(args.trial, args.steps)))
        return
    codes = {"before": _export(args.before_ref), "after": _ROOT}
    results = {k: {"draws": [], "time": []} for k in codes}
    for _ in range(args.trials):   # interleaved
        for name, code in codes.items():
            results[name]["draws"].append(_run(code, "draws", args.steps))
            results[name]["time"].append(_run(code, "time", args.steps))
    summary = {}
    for name, r in results.items():
        summary[name] = {
            "draws_per_replica": r["draws"][0]["draws_per_replica"],
            "random_ops_per_step": r["draws"][0]["random_ops"],
            "ms_per_step": statistics.median(
                t["ms_per_step"] for t in r["time"]),
            "peak_rss_mb": min(t["peak_rss_mb"] for t in r["time"])}
    ratios = {key: summary["after"][key] / summary["before"][key]
              for key in ("draws_per_replica", "ms_per_step", "peak_rss_mb")}
    report = {"config": {"replicas": N, "global_batch": BATCH,
                         "width": WIDTH, "trials": args.trials,
                         "steps": args.steps,
                         "before_ref": args.before_ref,
                         "load": os.getloadavg()},
              "summary": summary, "after_over_before": ratios,
              "trials": results}
    print(json.dumps(report, indent=1))
    out = os.path.join(_HERE, "results", "random_draws")
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(_markdown(report))


def _markdown(report):
    s, r, c = report["summary"], report["after_over_before"], report["config"]
    rows = "\n".join(
        f"{name:<8} {v['draws_per_replica']:>12,.0f} "
        f"{v['ms_per_step']:>9.1f} {v['peak_rss_mb']:>9.0f}"
        for name, v in s.items())
    return (
        "# Random numbers per replica per step (bench_random.py)\n\n"
        f"`python benchmarks/bench_random.py --trials {c['trials']}`; "
        f"before = `{c['before_ref']}` (global draw, rows gathered), after "
        "= counter-offset Philox draws of the replica's rows. Dropout MLP "
        f"256-{c['width']}-{c['width']}-10, global batch "
        f"{c['global_batch']}, {c['replicas']} logical CPUs, strategy "
        f"path; load average {c['load'][0]:.1f} (shared 2-core VM). Draws "
        "are counted from TF's debugger dump of the executed step; ms/step "
        "is the median of interleaved fresh processes; RSS the lower "
        "peak.\n\n```\n"
        "code      draws/replica   ms/step   peak MB\n"
        f"{rows}\n```\n\n"
        f"after / before: draws {r['draws_per_replica']:.3f}, "
        f"ms/step {r['ms_per_step']:.2f}, peak RSS "
        f"{r['peak_rss_mb']:.2f}.\n")


if __name__ == "__main__":
    main()
