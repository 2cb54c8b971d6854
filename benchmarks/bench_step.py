"""Step-time benchmark: single-device Keras, native tf.distribute, keras-mirror.

Runs, side by side and interleaved, three ways of training the same model on
the same global batch of synthetic data:

- `single`: plain single-device Keras `fit`.
- `native`: stock Keras `fit` with the model built and compiled inside
  `tf.distribute.MirroredStrategy(devices)`.
- `mirrored`: `keras_mirror.MirroredModel(model, devices=devices)`, on the
  one execution path (`strategy`, on every device kind).
- `mirrored_strategy`: the same with `execution="strategy"`, the
  `tf.distribute.MirroredStrategy` path, for comparison.

Each trial (one model, one variant, one replica count) runs in a fresh
subprocess, so that its peak RSS and its tracing time are its own. Trials are
interleaved: every repeat runs every configuration once, in an order rotated
from repeat to repeat, so that slow phases of a shared machine spread over all
configurations. See `benchmarks/README.md`.

Usage:

    python benchmarks/bench_step.py            # full run
    python benchmarks/bench_step.py --quick    # smoke run, noisy numbers
"""

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import bench_models
import bench_report

_START = time.perf_counter()
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

VARIANTS = ("single", "native", "mirrored", "mirrored_strategy",
            "mirrored_baseline")
MODELS = bench_models.MODELS
SCHEMA_VERSION = 2
_SETTINGS = (
    "quick", "batch_size", "steps", "warmup", "repeats", "models",
    "variants", "seed", "native_all_reduce", "baseline",
)


# --------------------------------------------------------------------------
# Worker side: one trial in this process.
# --------------------------------------------------------------------------


def _setup_tensorflow(cfg):
    """Imports TF, splitting the CPU if `cfg` uses CPUs; returns tf, keras."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    root = cfg.get("root") or _ROOT  # `--baseline`: another checkout
    if root not in sys.path:
        sys.path.insert(0, root)
    import tensorflow as tf

    if any("cpu" in d.lower() for d in cfg["devices"]):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * cfg["num_cpus"]
        )
    import keras

    return tf, keras


def _build_model(keras, name):
    """`(uncompiled model, row shape)` (`bench_overhead`, `bench_xla`)."""
    model, _, shape = bench_models.build(keras, name)
    return model, shape


def _compile(keras, model):
    bench_models.compile_keras(keras)(model)


def _make_data(shape, num_samples, seed=0):
    return bench_models.data(None, shape, num_samples, seed)


def _make_timer(keras):
    class StepTimer(keras.callbacks.Callback):
        """Records `time.perf_counter()` at the end of every step.

        Overriding `on_train_batch_end` makes Keras dispatch batch hooks
        synchronously and convert the step's logs to Python floats, so that
        each recorded time follows the end of its step on the device.
        """

        def __init__(self):
            super().__init__()
            self.batch_ends = []
            self.cpu_ends = []  # process CPU time, every thread

        def on_train_batch_end(self, batch, logs=None):
            self.batch_ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())

    return StepTimer()


def _prepare(tf, keras, cfg, devices):
    """Builds and compiles the configured variant; returns the model."""
    variant = cfg["variant"]
    name = cfg["model"]
    if variant == "single":
        with tf.device(devices[0]):
            model, compile, _ = bench_models.build(keras, name)
            compile(model)
        return model
    if variant == "native":
        ops = None  # TensorFlow's own choice, as a stock user gets it
        if cfg["native_all_reduce"] == "one-device":
            ops = tf.distribute.ReductionToOneDevice(devices[0])
        strategy = tf.distribute.MirroredStrategy(
            devices=devices, cross_device_ops=ops
        )
        with strategy.scope():
            model, compile, _ = bench_models.build(keras, name)
            compile(model)
        return model
    if variant.startswith("mirrored"):
        import keras_mirror

        model, compile, _ = bench_models.build(keras, name)
        own_step = name in bench_models.OWN_STEP
        if own_step:
            compile(model)
        execution = "strategy" if variant == "mirrored_strategy" else "auto"
        mirrored = keras_mirror.MirroredModel(model, devices=devices,
                                              execution=execution)
        if not own_step:
            compile(mirrored)
        return mirrored
    raise ValueError(
        f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}"
    )


def _peak_rss_mb():
    """Peak resident set size of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes vs KiB
    return peak * scale / 2**20


def _current_rss_mb():
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def run_trial(cfg):
    """Runs one trial as described by `cfg`; returns a dict of measurements."""
    tf, keras = _setup_tensorflow(cfg)
    keras.utils.set_random_seed(cfg["seed"])
    devices = cfg["devices"][: cfg["replicas"]]
    t_import = time.perf_counter()
    rss_import = _current_rss_mb()
    model = _prepare(tf, keras, cfg, devices)
    t_ready = time.perf_counter()
    batch, steps = cfg["batch_size"], cfg["warmup"] + cfg["steps"]
    shape = bench_models.SHAPES[cfg["model"]]
    x, y = bench_models.data(cfg["model"], shape, batch * steps,
                             seed=cfg["seed"])
    timer = _make_timer(keras)
    fit_kwargs = dict(batch_size=batch, epochs=1, shuffle=False, verbose=0)
    t_fit = time.perf_counter()
    if cfg["variant"] == "single":
        with tf.device(devices[0]):
            model.fit(x, y, callbacks=[timer], **fit_kwargs)
    else:
        model.fit(x, y, callbacks=[timer], **fit_kwargs)
    ends = timer.batch_ends
    if len(ends) != steps:
        raise RuntimeError(f"expected {steps} steps, timed {len(ends)}")
    step_ms = [
        1000.0 * (ends[i] - ends[i - 1]) for i in range(cfg["warmup"], steps)
    ]
    cpu = timer.cpu_ends  # work done per step, less sensitive to load
    cpu_ms = 1000.0 * (cpu[-1] - cpu[cfg["warmup"] - 1]) / cfg["steps"]
    return {
        "step_ms": step_ms,
        "median_step_ms": statistics.median(step_ms),
        "cpu_ms_per_step": cpu_ms,
        "first_step_s": ends[0] - t_fit,
        "setup_s": t_ready - t_import,
        "import_s": t_import - _START,
        "peak_rss_mb": _peak_rss_mb(),
        "rss_after_import_mb": rss_import,
        "devices": devices,
        "params": int(model.count_params()),
        "execution": getattr(model, "execution", None),
    }


def _worker_main(config_path, out_path):
    with open(config_path) as f:
        cfg = json.load(f)
    try:
        result = {"ok": True, **run_trial(cfg)}
    except Exception as e:  # reported to the parent, which carries on
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


# --------------------------------------------------------------------------
# Parent side: plan, run interleaved trials, aggregate, report.
# --------------------------------------------------------------------------


def _csv(kind):
    def parse(text):
        return [kind(v.strip()) for v in text.split(",") if v.strip()]

    return parse


def _parse_args(argv):
    p = argparse.ArgumentParser(
        description="Median ms/step, time to first step and peak RSS of "
        "single-device Keras, native MirroredStrategy and "
        "keras_mirror.MirroredModel, interleaved.",
    )
    p.add_argument("--devices", type=_csv(str), default=None,
                   help="comma-separated devices, e.g. /gpu:0,/gpu:1; "
                   "default: all GPUs, else logical CPUs")
    p.add_argument("--replicas", type=_csv(int), default=None,
                   help="replica counts to run (default 1,2,4)")
    p.add_argument("--models", type=_csv(str), default=list(MODELS),
                   help="models to run (default: all of "
                   f"{','.join(MODELS)})")
    p.add_argument("--variants", type=_csv(str), default=list(VARIANTS),
                   help="variants to run (default: all; mirrored_baseline "
                   "only with --baseline)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="a checkout of keras-mirror (e.g. a git worktree "
                   "of main) whose MirroredModel runs as the "
                   "`mirrored_baseline` variant, interleaved: before/after")
    p.add_argument("--baseline-label", default=None,
                   help="what the baseline is, for the report (default: "
                   "`git describe` in DIR)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="global batch size (default 256)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per trial (default 50; quick 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed first steps per trial (default 2; quick 1)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved trials per config (default 5; quick 1)")
    p.add_argument("--quick", action="store_true",
                   help="fast smoke run: few steps, one repeat")
    p.add_argument("--trial-timeout", type=float, default=600.0,
                   help="seconds before a trial is killed (default 600)")
    p.add_argument("--out", default=None,
                   help="output path prefix for .json and .md (default "
                   "benchmarks/results/bench_step-<machine>-<time>)")
    p.add_argument("--native-all-reduce", choices=("default", "one-device"),
                   default="default",
                   help="cross-device ops of the native strategy: "
                   "TensorFlow's default, or ReductionToOneDevice (what "
                   "keras-mirror picks on CPUs); default: default")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    if args.steps is None:
        args.steps = 5 if quick else 50
    if args.warmup is None:
        args.warmup = 1 if quick else 2
    if args.repeats is None:
        args.repeats = 1 if quick else 5
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        p.error("--steps, --warmup and --repeats must be at least 1")
    for name in args.models:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; choose from {MODELS}")
    for name in args.variants:
        if name not in VARIANTS:
            p.error(f"unknown variant {name!r}; choose from {VARIANTS}")
    return args


def _probe_environment():
    """Imports TF in the parent; returns (machine, num_gpus, mirrored_note).

    `mirrored_note` is None when `keras_mirror.MirroredModel` imports, else
    says why the `mirrored` variant is skipped.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import keras
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    machine = bench_report.describe_machine(tf, keras, gpus)
    try:
        from keras_mirror import MirroredModel  # noqa: F401
    except Exception as e:  # not written yet, or mid-edit
        return machine, len(gpus), (
            "skipped: `keras_mirror.MirroredModel` cannot be imported "
            f"({type(e).__name__}: {e})"
        )
    return machine, len(gpus), None


def _plan(args, num_gpus):
    """Returns (devices, num_cpus, configs, notes)."""
    replicas = args.replicas or [1, 2, 4]
    if args.devices:
        devices = list(args.devices)
    elif num_gpus:
        devices = [f"/gpu:{i}" for i in range(num_gpus)]
    else:
        devices = [f"/cpu:{i}" for i in range(max(replicas))]
    num_cpus = max(
        [max(replicas)]
        + [int(d.rsplit(":", 1)[1]) + 1 for d in devices
           if "cpu" in d.lower() and ":" in d]
    )
    configs, notes = [], []
    for model in args.models:
        if "single" in args.variants:
            configs.append(_config(args, model, "single", 1, devices, num_cpus))
        for n in replicas:
            if n > len(devices):
                notes.append(f"N={n} skipped: only {len(devices)} devices")
                continue
            for variant in VARIANTS[1:]:
                if variant not in args.variants or _skip(
                        args, model, variant, notes):
                    continue
                if variant == "native" and args.batch_size % n:
                    notes.append(
                        f"native N={n} skipped: batch {args.batch_size} "
                        "does not split evenly (stock Keras crashes)"
                    )
                    continue
                configs.append(
                    _config(args, model, variant, n, devices, num_cpus)
                )
    return devices, num_cpus, configs, sorted(set(notes))


def _skip(args, model, variant, notes):
    """Whether `variant` of `model` is left out (with a note saying why)."""
    if variant == "mirrored_baseline" and not args.baseline:
        return True  # asked for by --baseline only
    if variant == "native" and model in bench_models.OWN_STEP:
        notes.append(f"{model}: native not run: stock Keras 3.15 `fit` of a "
                     "GAN's own train_step under MirroredStrategy fails "
                     "(InvalidArgumentError at `cond/Placeholder_1` in "
                     "`multi_step_on_iterator`)")
        return True
    if variant == "mirrored_strategy" and model in bench_models.OWN_STEP:
        notes.append(f"{model}: mirrored_strategy not run: a model with its "
                     "own train_step runs the strategy path as `mirrored`")
        return True
    return False


def _config(args, model, variant, replicas, devices, num_cpus):
    root = args.baseline if variant == "mirrored_baseline" else None
    return {
        "root": root and os.path.abspath(root),
        "model": model,
        "variant": variant,
        "replicas": replicas,
        "devices": devices,
        "num_cpus": num_cpus,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "native_all_reduce": args.native_all_reduce,
    }


def _run_subprocess(cfg, timeout):
    """Runs one trial in a fresh interpreter; returns its result dict."""
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        out_path = os.path.join(tmp, "result.json")
        with open(config_path, "w") as f:
            json.dump(cfg, f)
        cmd = [sys.executable, os.path.abspath(__file__),
               "--worker", config_path, out_path]
        try:
            proc = subprocess.run(  # SIGKILL on timeout: TF ignores SIGTERM
                cmd, capture_output=True, text=True, timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
        if os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        return {
            "ok": False,
            "error": f"worker exited with code {proc.returncode}: "
            + " | ".join(tail),
        }


def _run_all(args, configs, after_round=None):
    """Runs `args.repeats` rounds over `configs`, rotating the order.

    `after_round(trials)` is called after each round (the report so far).
    """
    trials = {bench_report.key(c): [] for c in configs}
    total = len(configs) * args.repeats
    done = 0
    for r in range(args.repeats):
        shift = r % len(configs)
        for cfg in configs[shift:] + configs[:shift]:
            done += 1
            key = bench_report.key(cfg)
            print(f"[{done}/{total}] repeat {r + 1}: {key} ...",
                  end=" ", flush=True)
            result = _run_subprocess(cfg, args.trial_timeout)
            trials[key].append(result)
            if result["ok"]:
                print(f"{result['median_step_ms']:.2f} ms/step, "
                      f"{result['cpu_ms_per_step']:.2f} CPU ms/step",
                      flush=True)
            else:
                print(f"FAILED ({result['error']})", flush=True)
        if after_round is not None and r + 1 < args.repeats:
            after_round(trials)
    return trials

def main(argv=None):
    """Runs the benchmark; returns 1 if a trial failed, 2 if none ran."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    if args.worker:
        return _worker_main(*args.worker)
    loadavg_before = bench_report.loadavg()
    machine, num_gpus, mirrored_note = _probe_environment()
    if mirrored_note and "mirrored" in args.variants:
        args.variants = [v for v in args.variants
                         if not v.startswith("mirrored")]
        print(f"MirroredModel {mirrored_note}", flush=True)
    devices, num_cpus, configs, notes = _plan(args, num_gpus)
    if mirrored_note:
        notes.insert(0, f"MirroredModel {mirrored_note}")
    if not configs:
        print("Nothing to run.", file=sys.stderr)
        return 2
    print(f"Devices: {devices}; {len(configs)} configs x {args.repeats} "
          f"repeats, {args.steps} timed steps each", flush=True)
    out = args.out or bench_report.default_out()

    def report(trials):
        """Writes the report of `trials` (each round's, then the last)."""
        rows = bench_report.summarise(configs, trials)
        bench_report.write(_report(args, argv, machine, devices, num_cpus,
                                   loadavg_before, notes, rows, trials), out)
        return rows

    rows = report(_run_all(args, configs, after_round=report))
    return 1 if any(r["trials_failed"] for r in rows) else 0


def _report(args, argv, machine, devices, num_cpus, loadavg_before, notes,
            rows, trials):
    settings = {k: getattr(args, k) for k in _SETTINGS}
    return {
        "schema_version": SCHEMA_VERSION,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/bench_step.py", *argv]),
        "machine": machine,
        "settings": dict(settings, devices=devices, num_cpus=num_cpus,
                         baseline_commit=args.baseline and (
                             args.baseline_label
                             or bench_report.git_commit(args.baseline))),
        "loadavg_before": loadavg_before,
        "loadavg_after": bench_report.loadavg(),
        "notes": notes,
        "results": rows,
        "ratios": bench_report.ratios(rows),
        "trials": trials,
    }



if __name__ == "__main__":
    sys.exit(main())
