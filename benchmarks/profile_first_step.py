"""Where the first step's time goes as the number of replicas grows.

Each trial is a fresh process that wraps a model over N logical CPUs, runs
one `fit` step (so that every one-time Keras build is done), then times a
new `tf.function` of the wrapper's `train_step` in three parts:

- `trace`: `get_concrete_function` (Python tracing into a graph);
- `first_call`: the first call of that concrete function: the runtime's
  graph optimisation (grappler), placement, partitioning, executor
  creation, and one step;
- `run`: a later call (the step alone), so `first_call - run` is the
  runtime's one-time work.

With `--grappler` the process runs with TensorFlow's grappler logging on
(`TF_CPP_VMODULE=meta_optimizer=1`) and reports each optimizer's time for
the step's graph; `--off PASS` switches one grappler option off
(`tf.config.optimizer.set_experimental_options`), `--off meta` switches
the whole meta optimizer off.

    python benchmarks/profile_first_step.py --model mlp --replicas 1 4 8
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_MARK = "=== keras-mirror profile: step function ==="
# "I0000 ... meta_optimizer.cc:973] constant_folding: Graph size after: 917
# nodes (-85), 1527 edges (-215), time = 127.843ms."
_PASS = re.compile(r"\] (\w+)[^:]*: Graph size after: .*time = ([\d.]+)ms")


def _model(name, execution, jit=False):
    sys.path.insert(0, os.path.join(_ROOT, "tests", "support"))
    sys.path.insert(0, _HERE)
    import bench_first_step
    import guide_models
    import keras

    keras.utils.set_random_seed(0)
    if name == "mlp":
        model, kwargs, (x, y), batch = bench_first_step._mlp(keras, jit)
    else:
        model, kwargs, (x, _) = guide_models.wgan_gp()
        y, batch = None, 14
    model.compile(**kwargs)
    return model, x, y, batch


def _trial(replicas, name, execution, off, grappler):
    import keras_mirror

    devices = keras_mirror.logical_cpus(max(replicas, 1))
    import tensorflow as tf

    model, x, y, batch = _model(name, execution)
    mirrored = keras_mirror.MirroredModel(
        model, devices=devices[:replicas], execution=execution)
    mirrored.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1,
                 verbose=0)
    if off == "meta":
        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": True})
    elif off:
        tf.config.optimizer.set_experimental_options({off: False})
    with mirrored._homes.mirrored():  # the variables as `fit` has them
        xb = tf.constant(x[:batch])
        args = (xb,) if y is None else (xb, tf.constant(y[:batch]))
        # As Keras wraps the step (no autograph of the wrapper's Python:
        # its steps use no Python control flow on tensors).
        step = tf.function(lambda *data: mirrored.train_step(
            data[0] if len(data) == 1 else data), autograph=False)
        start, cpu = time.perf_counter(), time.process_time()
        concrete = step.get_concrete_function(*args)
        trace = time.perf_counter() - start
        trace_cpu = time.process_time() - cpu
        nodes = len(concrete.graph.as_graph_def().node)
        sys.stderr.write(_MARK + "\n")
        sys.stderr.flush()
        start, cpu = time.perf_counter(), time.process_time()
        concrete(*args)
        first = time.perf_counter() - start
        first_cpu = time.process_time() - cpu
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            concrete(*args)
            runs.append(time.perf_counter() - start)
    print(json.dumps({"trace_s": trace, "first_call_s": first,
                      "trace_cpu_s": trace_cpu, "first_call_cpu_s": first_cpu,
                      "run_s": statistics.median(runs), "nodes": nodes,
                      "path": mirrored.execution}))


def _passes(stderr):
    """Grappler's per-optimizer time (ms) for the step's graph."""
    times = {}
    after = stderr.split(_MARK, 1)[-1]
    for line in after.splitlines():
        m = _PASS.search(line)
        if m:
            times[m.group(1)] = times.get(m.group(1), 0.0) + float(m.group(2))
    return times


def _run(replicas, args):
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", _ROOT)  # another checkout: set it
    if args.grappler:
        env.update(TF_CPP_MIN_LOG_LEVEL="0",
                   TF_CPP_VMODULE="meta_optimizer=1")
    else:
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    command = [sys.executable, __file__, "--trial", str(replicas),
               "--model", args.model, "--execution", args.execution]
    if args.off:
        command += ["--off", args.off]
    out = subprocess.run(command, capture_output=True, text=True,
                         timeout=1200, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if args.grappler:
        result["grappler_ms"] = _passes(out.stderr)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--model", default="mlp", choices=["wgan_gp", "mlp"])
    parser.add_argument("--execution", default="auto",
                        choices=["auto", "strategy"])
    parser.add_argument("--off", default="",
                        help="a grappler option to switch off, or 'meta'")
    parser.add_argument("--grappler", action="store_true",
                        help="report grappler's per-pass times")
    parser.add_argument("--json", help="append the results to this file")
    parser.add_argument("--trial", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial is not None:
        _trial(args.trial, args.model, args.execution, args.off,
               args.grappler)
        return 0
    results = {n: [] for n in args.replicas}
    for _ in range(args.trials):
        for n in args.replicas:
            results[n].append(_run(n, args))
    print(f"model={args.model} execution={args.execution} "
          f"off={args.off or '-'}, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}, medians of "
          f"{args.trials} interleaved fresh-process trials")
    print("trace and first call: wall seconds (process CPU seconds)")
    print(f"{'N':>3}{'path':>10}{'nodes':>7}{'trace s':>14}"
          f"{'1st call s':>14}{'run s':>8}{'grappler ms':>12}")
    summary = {}
    for n, trials in results.items():
        med = {k: statistics.median(t[k] for t in trials)
               for k in ("trace_s", "first_call_s", "run_s", "nodes",
                         "trace_cpu_s", "first_call_cpu_s")}
        passes = {}
        for t in trials:
            for k, v in t.get("grappler_ms", {}).items():
                passes.setdefault(k, []).append(v)
        med["grappler_ms"] = {k: statistics.median(v)
                              for k, v in passes.items()}
        summary[n] = dict(med, path=trials[0]["path"])
        total = sum(med["grappler_ms"].values())
        trace = f"{med['trace_s']:.2f} ({med['trace_cpu_s']:.2f})"
        first = f"{med['first_call_s']:.2f} ({med['first_call_cpu_s']:.2f})"
        print(f"{n:>3}{trials[0]['path']:>10}{med['nodes']:>7.0f}"
              f"{trace:>14}{first:>14}"
              f"{med['run_s']:>8.3f}{total:>12.0f}")
        if passes:
            top = sorted(med["grappler_ms"].items(), key=lambda kv: -kv[1])
            print("      " + ", ".join(f"{k} {v:.0f}" for k, v in top[:6]))
    if args.json:
        record = {"model": args.model, "execution": args.execution,
                  "off": args.off, "trials": args.trials,
                  "load": os.getloadavg(), "results": summary}
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
