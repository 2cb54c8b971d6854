"""Time to the first step of a model with its own `train_step` (a WGAN-GP).

Each trial is a fresh process that builds the keras.io-style WGAN-GP of
`tests/support/guide_models.py` and times `fit` of one step (trace, compile
and the step itself), on one device with the model's own `fit` and wrapped by
`MirroredModel` over N logical CPUs. Trials of the configurations are
interleaved; the medians and their ratios are printed side by side.

    python benchmarks/bench_first_step.py --trials 3 --replicas 1 2 4
    python benchmarks/bench_first_step.py --model mlp --replicas 1 4 8 \
        --baseline /path/to/other/checkout --json results.json
    python benchmarks/bench_first_step.py --model mlp --execution strategy \
        --replicas 2 4 8 --baseline /path/to/other/checkout

`--baseline` runs every MirroredModel configuration a second time with
another checkout's `keras_mirror` (its directory put first on
`PYTHONPATH`), interleaved with this one's, so that a change is measured
side by side on the same loaded machine. See `profile_first_step.py` for
where the time goes (trace, first call, grappler).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def _classifier(keras, jit, hidden):
    """An MLP 64-(hidden)-10 on Keras's own step, batch 256."""
    import numpy as np

    model = keras.Sequential([keras.Input((64,))] + [
        keras.layers.Dense(width, activation="relu") for width in hidden]
        + [keras.layers.Dense(10)])
    compile_kwargs = dict(optimizer="adam", jit_compile=jit,
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 64)).astype("float32")
    y = rng.integers(0, 10, 1024).astype("int32")
    return model, compile_kwargs, (x, y), 256


def _mobilenet(keras):
    """keras.applications MobileNet (alpha 0.25, 32x32, `weights=None`):
    27 plain BatchNormalization layers, Adam, batch 32."""
    import numpy as np

    model = keras.applications.MobileNet(
        alpha=0.25, weights=None, input_shape=(32, 32, 3), classes=10)
    compile_kwargs = dict(optimizer="adam",
                          loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 128).astype("int32")
    return model, compile_kwargs, (x, y), 32


# "mlp": 64-256-256-10; "deep_mlp": 16 hidden layers of 64, 34 variables
# (the optimizer's update a larger part of the first step).
_HIDDEN = {"mlp": (256, 256), "deep_mlp": (64,) * 16}


def _trial(replicas, name="wgan_gp", jit=False, execution="auto"):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path.insert(0, os.path.join(_ROOT, "tests", "support"))
    import keras_mirror

    devices = keras_mirror.logical_cpus(max(replicas, 1))
    import guide_models
    import keras

    keras.utils.set_random_seed(0)
    if name in _HIDDEN:
        model, compile_kwargs, (x, y), batch = _classifier(
            keras, jit, _HIDDEN[name])
    elif name == "mobilenet":
        model, compile_kwargs, (x, y), batch = _mobilenet(keras)
    else:
        model, compile_kwargs, (x, _) = guide_models.wgan_gp()
        y, batch = None, 14
    model.compile(**compile_kwargs)
    target = model if replicas == 0 else keras_mirror.MirroredModel(
        model, devices=devices[:replicas], execution=execution)
    start = time.perf_counter()
    target.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1,
               verbose=0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    target.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=3,
               verbose=0)
    steps = (time.perf_counter() - start) / 3
    print(json.dumps({"first_step_s": first, "later_step_s": steps}))


def _run(replicas, name, jit, root=None, execution="auto"):
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = root
    out = subprocess.run(
        [sys.executable, __file__, "--trial", str(replicas), "--model", name,
         "--execution", execution] + (["--jit"] if jit else []),
        capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="wgan_gp",
                        choices=["wgan_gp", "mlp", "deep_mlp", "mobilenet"])
    parser.add_argument("--jit", action="store_true",
                        help="compile the model with jit_compile=True")
    parser.add_argument("--execution", default="auto",
                        choices=["auto", "strategy"],
                        help="MirroredModel's execution path")
    parser.add_argument("--baseline", help="another checkout to compare")
    parser.add_argument("--json", help="append the medians to this file")
    parser.add_argument("--trial", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial is not None:
        _trial(args.trial, args.model, args.jit, args.execution)
        return 0
    configs = [(0, None)] + [(n, None) for n in args.replicas]
    if args.baseline:
        configs += [(n, args.baseline) for n in args.replicas]
    results = {c: [] for c in configs}
    load = []
    for _ in range(args.trials):
        for c in configs:
            results[c].append(_run(c[0], args.model, args.jit, c[1],
                                   args.execution)["first_step_s"])
            load.append(os.getloadavg()[0])
    _print(args, results, load)
    return 0


def _print(args, results, load):
    medians = {c: statistics.median(t) for c, t in results.items()}
    single = medians[(0, None)]
    print(f"model={args.model} jit_compile={args.jit} "
          f"execution={args.execution}, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} (1-min load "
          f"during the trials {min(load):.1f}-{max(load):.1f}), medians of "
          f"{args.trials} interleaved fresh-process trials")
    print(f"{'configuration':<28}{'first step (s)':>16}{'/ one device':>14}"
          f"{'/ N=4':>8}")
    print(f"{'one device (model.fit)':<28}{single:>16.2f}{1.0:>14.2f}")
    rows = []
    for (n, root), median in medians.items():
        if n == 0:
            continue
        name = f"MirroredModel, N={n}" + (" (baseline)" if root else "")
        four = medians.get((4, root))
        per_four = f"{median / four:>8.2f}" if four else ""
        print(f"{name:<28}{median:>16.2f}{median / single:>14.2f}"
              f"{per_four}")
        rows.append({"replicas": n, "baseline": bool(root),
                     "first_step_s": median, "per_one_device": median / single,
                     "trials": results[(n, root)]})
    if args.json:
        record = {"model": args.model, "jit_compile": args.jit,
                  "execution": args.execution,
                  "trials": args.trials, "load_during": [min(load),
                                                         max(load)],
                  "one_device_s": single, "one_device_trials":
                  results[(0, None)], "configurations": rows}
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    sys.exit(main())
