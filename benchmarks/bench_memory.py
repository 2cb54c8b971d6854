"""Peak RSS of training on the `strategy` path against native MirroredStrategy.

Each configuration runs in a fresh process on 2 logical CPUs: a wide MLP
(about 25M float32 parameters, 100 MB of weights, 300 MB with Adam's two
slots) trained 3 steps with

- `one device`: the model's own `fit`;
- `native`: stock Keras `fit`, model built and compiled inside
  `tf.distribute.MirroredStrategy`;
- `MirroredModel`: `execution="strategy"` (each variable's idle
  single-device backing released while the mirrored copy trains);
- `MirroredModel, backing kept` (`--with-base DIR`): the same from a
  checkout of the code before that change, for comparison.

Usage:

    python benchmarks/bench_memory.py [--with-base /path/to/old/checkout]
"""

import argparse
import json
import os
import resource
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def _trial(kind):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_mirror

    devices = keras_mirror.logical_cpus(2)
    import keras
    import numpy as np
    import tensorflow as tf

    def build():
        model = keras.Sequential([
            keras.Input((2048,)), keras.layers.Dense(4096, activation="relu"),
            keras.layers.Dense(4096, activation="relu"),
            keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
        return model

    x = np.random.default_rng(0).standard_normal((192, 2048)).astype(
        "float32")
    y = np.zeros((192,), "int32")
    if kind == "native":
        with tf.distribute.MirroredStrategy(devices).scope():
            target = build()
    elif kind == "one device":
        target = build()
    else:
        target = keras_mirror.MirroredModel(build(), devices=devices,
                                            execution="strategy")
    target.fit(x, y, batch_size=64, epochs=1, verbose=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mb": peak}))


def _run(kind, root):
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, __file__, "--trial", kind],
                         capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--with-base", default=None)
    parser.add_argument("--trial", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        _trial(args.trial)
        return
    configs = [("one device", _ROOT), ("native", _ROOT),
               ("MirroredModel", _ROOT)]
    if args.with_base:
        configs.append(("MirroredModel, backing kept", args.with_base))
    peaks = {name: [] for name, _ in configs}
    for _ in range(args.trials):
        for name, root in configs:
            kind = "mirrored" if name.startswith("MirroredModel") else name
            peaks[name].append(_run(kind, root))
    native = min(peaks["native"])
    print(f"{'configuration (2 logical CPUs)':<32}{'peak RSS MB':>12}"
          f"{'/ native':>10}")
    for name, values in peaks.items():
        print(f"{name:<32}{min(values):>12.0f}{min(values) / native:>10.2f}")


if __name__ == "__main__":
    main()
