"""How far `fit`'s input travels through keras_mirror before the first step.

Follows `x` from `MirroredModel.fit` to the first `train_step` (issue 40,
item 5: "following `x`, each module is entered once"): a profiler on every
call into keras_mirror records the functions that receive `x`, or a value
that an earlier such function returned, as an argument, and prints the
modules in the order the data visits them, how often it comes back to a
module it had left, and the functions it passes through. Run from the
repository root, in the project's environment:

    python benchmarks/input_walk.py            # arrays, x and y
    python benchmarks/input_walk.py dataset    # a tf.data.Dataset

A value is followed by identity, so a copy made by TensorFlow or NumPy
(a slice, a new dataset) starts a new trail only where a keras_mirror
function returned it.
"""

import os
import sys

import keras_mirror

keras_mirror.logical_cpus(4)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

PKG = os.path.dirname(keras_mirror.__file__)


class Trail:
    """Calls into keras_mirror that carry a followed value."""

    def __init__(self, value):
        self.followed = {id(value): value}
        self.open = set()
        self.calls = []
        self.stopped = False

    def profile(self, frame, event, arg):
        if self.stopped or not frame.f_code.co_filename.startswith(PKG):
            return
        if event == "call":
            if any(id(v) in self.followed
                   for v in list(frame.f_locals.values())):
                self.open.add(id(frame))
                self.calls.append((os.path.relpath(
                    frame.f_code.co_filename, PKG), frame.f_code.co_name))
        elif event == "return" and id(frame) in self.open:
            self.open.discard(id(frame))
            for v in arg if isinstance(arg, tuple) else (arg,):
                if v is not None and not isinstance(v, (bool, int, float,
                                                        str)):
                    self.followed[id(v)] = v


def main(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, 64)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.Dense(3)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    mirrored = keras_mirror.MirroredModel(model)
    if kind == "dataset":
        args, kwargs = (tf.data.Dataset.from_tensor_slices((x, y))
                        .batch(32),), {}
    else:
        args, kwargs = (x, y), {"batch_size": 32}
    trail = Trail(args[0])
    original = type(mirrored).train_step

    def first_step(self, data):
        trail.stopped = True
        sys.setprofile(None)
        return original(self, data)

    type(mirrored).train_step = first_step
    sys.setprofile(trail.profile)
    try:
        mirrored.fit(*args, epochs=1, verbose=0, **kwargs)
    finally:
        sys.setprofile(None)
        type(mirrored).train_step = original
    path = []
    for module, _ in trail.calls:
        if not path or path[-1] != module:
            path.append(module)
    print(" -> ".join(path))
    print(f"input walk ({kind}): {len(set(path))} modules, "
          f"{len(path) - len(set(path))} returns to a module already left, "
          f"{len(set(trail.calls))} functions")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "arrays")
