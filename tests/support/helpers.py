"""Shared builders for the tests: small models, data, references, paths."""

import pathlib

import keras
import numpy as np

# The repository's folders, wherever a test module sits under tests/.
ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "support" / "workers"
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"


def lean(code):
    """`code` for `python -c`, after `workers/_lean.py`: a test's own
    TensorFlow process starts without Keras's optional imports, as the
    harness's workers do (1.1-2.0 CPU-s each)."""
    return (f"import sys\nsys.path.insert(0, {str(WORKERS)!r})\n"
            "import _lean  # noqa: F401\nsys.path.pop(0)\n" + code)


def mlp(regularize=True, seed=0):
    keras.utils.set_random_seed(seed)
    reg = keras.regularizers.L2(0.01) if regularize else None
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=reg),
        keras.layers.Dense(3),
    ])


def data(rows, seed=1, features=6, outputs=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = rng.normal(size=(rows, outputs)).astype("float32")
    sw = rng.uniform(0.1, 2.0, size=(rows,)).astype("float32")
    return x, y, sw


def batches(x, y, sizes):
    """A `tf.data` input of consecutive batches of `sizes` rows of (x, y)."""
    import numpy as np
    import tensorflow as tf

    ends = np.cumsum(sizes)
    parts = [tf.data.Dataset.from_tensors((x[e - s:e], y[e - s:e]))
             for s, e in zip(sizes, ends)]
    ds = parts[0]
    for part in parts[1:]:
        ds = ds.concatenate(part)
    return ds


def max_diff(a_weights, b_weights):
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(a_weights, b_weights))


class OwnStep(keras.Model):
    """One Dense layer and a `train_step` of its own (Keras's, overridden)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        return super().train_step(data)


def own_step_model(features=None):
    """An `OwnStep` model, built for `features` inputs when given."""
    model = OwnStep()
    if features is not None:
        # Called once, so that its layers create their weights: `build`
        # would mark the subclass built without any (Keras warns).
        model(np.zeros((1, features), "float32"))
    return model


def summary_cells(mirrored):
    """`mirrored.summary()`'s header table as {setting: value}.

    A value that wraps over several lines is joined back with spaces.
    """
    lines = []
    mirrored.summary(print_fn=lines.append)
    header = lines[0].split("\nModel:")[0]
    cells, setting = {}, None
    for line in header.splitlines():
        if not line.startswith("│"):
            continue
        left, right = (part.strip() for part in line.strip("│").split("│"))
        setting = left or setting
        cells[setting] = f"{cells[setting]} {right}" if not left else right
    return header, cells


def once(cache, key, compute):
    """`compute()`'s result for `key`, computed the first time it is asked.

    For a module-scoped `cache` of one device's runs: a test that runs on
    both execution paths compares both with the same reference run.
    """
    if key not in cache:
        cache[key] = compute()
    return cache[key]
