"""Soak benchmark: thousands of uneven steps, memory flat, weights exact.

Trains a small MLP with `keras_mirror.MirroredModel` for `--steps` steps
(default 3000) on global batches whose sizes cycle through an uneven
pattern (some smaller than the replica count, so some shards are empty),
with per-replica logging on (`ReplicaTensorBoard` writing one run per
replica, and the engine's `replica_history`). Alongside, it trains the same
model from the same initial weights on one device with plain Keras on the
same batches. It reports:

- resident memory (RSS, via psutil) after a warm-up and at the end, and
  sampled every `--sample-every` steps, with the least-squares slope of the
  samples taken after warm-up (MB per 1000 steps);
- the step time of both runs (median of the per-interval means);
- the largest absolute difference between the final weights of the two
  runs, and whether every replica saw the `split_plan` row counts.

The MLP uses `tanh`: with ReLU, a pre-activation within rounding of zero
flips a unit in one run and not the other, and the two trajectories part
by ~1e-4 in one step (seen at step 2139 of 3000 with ReLU, in float64 too),
which says nothing about exactness. RSS grows by design with the per-step
history that `replica_history["batch"]` keeps (reported as
`replica_history_mb`).

Prints a table and writes `benchmarks/results/soak.json`. Not a test: run
it by hand (`python benchmarks/soak.py`, or `--steps 300` for a quick look).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
PATTERN = (37, 64, 3, 101, 2, 50, 1, 77)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--sample-every", type=int, default=250)
    p.add_argument("--warmup", type=int, default=200,
                   help="steps before the 'start' RSS is taken")
    p.add_argument("--pattern", default=",".join(map(str, PATTERN)),
                   help="comma-separated global batch sizes, cycled")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32",
                                                           "float64"),
                   help="float64 separates summation-order drift from bugs")
    p.add_argument("--out", default=os.path.join(_HERE, "results",
                                                 "soak.json"))
    return p.parse_args(argv)


def _setup(replicas, dtype):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import keras

    import keras_mirror

    keras_mirror.logical_cpus(replicas)
    keras.config.set_floatx(dtype)


def _dataset(pattern, steps, seed):
    """`steps` global batches whose sizes cycle through `pattern`."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    rows = sum(pattern)
    dtype = keras.config.floatx()
    x = tf.constant(rng.normal(size=(rows, 32)).astype(dtype))
    y = tf.constant(rng.normal(size=(rows, 4)).astype(dtype))
    sizes = tf.constant(pattern, tf.int64)
    offsets = tf.cumsum(sizes, exclusive=True)

    def batch(i):
        k = i % len(pattern)
        start, size = offsets[k], sizes[k]
        return x[start:start + size], y[start:start + size]

    return tf.data.Dataset.range(steps).map(batch).prefetch(2)


def _model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64, activation="tanh"),
        keras.layers.Dense(64, activation="tanh"),
        keras.layers.Dense(4),
    ])


def _rss_mb():
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _probe(every):
    """A callback sampling RSS and wall time every `every` steps."""
    import keras

    class Probe(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.samples = []  # (step, rss_mb, seconds since last sample)
            self._last = None

        def on_train_batch_end(self, batch, logs=None):
            step = batch + 1
            if step % every == 0:
                now = time.perf_counter()
                spent = None if self._last is None else now - self._last
                self._last = now
                self.samples.append((step, _rss_mb(), spent))

    return Probe()


def _deep_size(obj):
    """Bytes held by a structure of dicts, lists, arrays and scalars."""
    size = sys.getsizeof(obj)
    if hasattr(obj, "nbytes"):  # arrays, and the StepHistory of "batch"
        size += obj.nbytes
    if isinstance(obj, dict):
        size += sum(_deep_size(k) + _deep_size(v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        size += sum(_deep_size(v) for v in obj)
    return size


def _slope(points):
    """Least-squares slope of (x, y) points; 0.0 with fewer than two."""
    if len(points) < 2:
        return 0.0
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def _ms_per_step(samples, every):
    spans = [s for _, _, s in samples if s is not None]
    return 1000 * statistics.median(spans) / every if spans else None


def _run_mirrored(args, pattern, initial, log_dir):
    import keras

    import keras_mirror

    model = _model(args.seed)
    model.set_weights(initial)
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(optimizer=keras.optimizers.SGD(args.lr), loss="mse")
    probe = _probe(args.sample_every)
    callbacks = [probe, keras_mirror.ReplicaTensorBoard(
        log_dir, update_freq=50)]
    rss_before = _rss_mb()
    mirrored.fit(_dataset(pattern, args.steps, args.seed), epochs=1,
                 verbose=0, shuffle=False, callbacks=callbacks)
    samples = mirrored.replica_history["batch"]
    plans_ok = all(
        tuple(int(v) for v in s["samples"])
        == mirrored.split_plan(pattern[i % len(pattern)])
        for i, s in enumerate(samples))
    return {
        "weights": mirrored.model.get_weights(),
        "samples": probe.samples,
        "rss_before_fit_mb": rss_before,
        "rss_end_mb": _rss_mb(),
        "steps_logged": len(samples),
        "split_plans_match": plans_ok,
        "replicas": mirrored.num_replicas,
        "nonfinite": int(sum(sum(s["nonfinite"]) for s in samples)),
        "replica_history_mb": _deep_size(mirrored.replica_history) / 2**20,
        "max_abs_weight": max(float(abs(w).max())
                              for w in mirrored.model.get_weights()),
    }


def _run_single(args, pattern, initial):
    import keras

    model = _model(args.seed)
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(args.lr), loss="mse")
    probe = _probe(args.sample_every)
    model.fit(_dataset(pattern, args.steps, args.seed), epochs=1, verbose=0,
              shuffle=False,
              callbacks=[probe])
    return {"weights": model.get_weights(), "samples": probe.samples}


def _summary(args, pattern, mirrored, single):
    import numpy as np

    after = [(s, r) for s, r, _ in mirrored["samples"] if s >= args.warmup]
    start = after[0][1] if after else mirrored["rss_before_fit_mb"]
    diff = max(float(np.max(np.abs(a - b)))
               for a, b in zip(mirrored["weights"], single["weights"]))
    return {
        "steps": args.steps,
        "replicas": mirrored["replicas"],
        "pattern": list(pattern),
        "rss_before_fit_mb": round(mirrored["rss_before_fit_mb"], 1),
        "rss_start_mb": round(start, 1),
        "rss_end_mb": round(mirrored["rss_end_mb"], 1),
        "rss_growth_mb": round(mirrored["rss_end_mb"] - start, 1),
        "rss_slope_mb_per_1000_steps": round(1000 * _slope(after), 2),
        "rss_samples": [[s, round(r, 1)] for s, r, _ in
                        mirrored["samples"]],
        "mirrored_ms_per_step": _ms_per_step(mirrored["samples"],
                                             args.sample_every),
        "single_ms_per_step": _ms_per_step(single["samples"],
                                           args.sample_every),
        "max_abs_weight_diff_vs_single": diff,
        "max_abs_weight": mirrored["max_abs_weight"],
        "dtype": args.dtype,
        "replica_history_mb": round(mirrored["replica_history_mb"], 2),
        "steps_logged": mirrored["steps_logged"],
        "split_plans_match": mirrored["split_plans_match"],
        "nonfinite_values": mirrored["nonfinite"],
    }


def _print_table(result):
    rows = [
        ("steps x replicas", f"{result['steps']} x {result['replicas']}"),
        ("batch pattern", ",".join(map(str, result["pattern"]))),
        ("RSS start (after warm-up)", f"{result['rss_start_mb']} MB"),
        ("RSS end", f"{result['rss_end_mb']} MB"),
        ("RSS growth", f"{result['rss_growth_mb']} MB"),
        ("RSS slope", f"{result['rss_slope_mb_per_1000_steps']} "
                      "MB / 1000 steps"),
        ("keras-mirror step", _ms(result["mirrored_ms_per_step"])),
        ("single-device step", _ms(result["single_ms_per_step"])),
        ("max |w_mirrored - w_single|",
         f"{result['max_abs_weight_diff_vs_single']:.3g} ({result['dtype']};"
         f" max |w| {result['max_abs_weight']:.3g})"),
        ("replica_history size", f"{result['replica_history_mb']} MB"),
        ("steps logged per replica", str(result["steps_logged"])),
        ("shards == split_plan", str(result["split_plans_match"])),
        ("non-finite values", str(result["nonfinite_values"])),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _ms(value):
    return "n/a" if value is None else f"{value:.2f} ms"


def main(argv=None):
    args = _args(argv)
    pattern = tuple(int(p) for p in args.pattern.split(","))
    if args.steps < 1 or args.sample_every < 1 or min(pattern) < 1:
        raise SystemExit("`--steps`, `--sample-every` and every batch size "
                         "must be positive.")
    _setup(args.replicas, args.dtype)
    initial = _model(args.seed).get_weights()
    with tempfile.TemporaryDirectory() as log_dir:
        mirrored = _run_mirrored(args, pattern, initial, log_dir)
    single = _run_single(args, pattern, initial)
    result = _summary(args, pattern, mirrored, single)
    import keras
    import tensorflow as tf

    result["versions"] = {"keras": keras.__version__,
                          "tensorflow": tf.__version__,
                          "python": platform.python_version()}
    _print_table(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
