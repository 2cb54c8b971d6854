"""The models `bench_step.py` trains, and their synthetic data.

- `mlp`: 64-256-256-10 dense, Keras's own step;
- `convnet`: 28x28x1, Conv2D(16)-MaxPool-Conv2D(32)-GlobalAvgPool-Dense(10);
- `convnet_bn`: the same with BatchNormalization after each convolution
  (non-trainable state written in training: the in-graph path's state
  guard runs);
- `gan`: the keras.io DCGAN-style GAN of `tests/support/guide_models.py`,
  with its own `train_step` and `compile(d_optimizer=..., g_optimizer=...,
  loss_fn=...)` (MirroredModel runs it on the `"strategy"` path).

Each builder returns `(model, compile, shape)`: the uncompiled model, a
function that compiles it (or its `MirroredModel`) as a user would, and
the shape of one input row. Nothing here imports TensorFlow at module level.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("mlp", "convnet", "convnet_bn", "dropout_mlp", "gan")
OWN_STEP = ("gan",)  # models with their own `train_step`
SHAPES = {"mlp": (64,), "convnet": (28, 28, 1), "convnet_bn": (28, 28, 1),
          "dropout_mlp": (256,), "gan": (6,)}


def compile_keras(keras):
    def compile(model):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
            jit_compile=False,
        )

    return compile


def _convnet(keras, batch_norm):
    layers = keras.layers
    out = [keras.Input((28, 28, 1))]
    for filters in (16, 32):
        if batch_norm:
            out += [layers.Conv2D(filters, 3), layers.BatchNormalization(),
                    layers.ReLU()]
        else:
            out.append(layers.Conv2D(filters, 3, activation="relu"))
        if filters == 16:
            out.append(layers.MaxPooling2D(2))
    return out + [layers.GlobalAveragePooling2D(), layers.Dense(10)]


def _gan(keras):
    tests = os.path.join(_ROOT, "tests", "support")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import guide_models

    model, kwargs, _ = guide_models.gan()
    # No `call`: Keras cannot build it; its sub-models hold every weight.
    model.built = True

    def compile(target):
        # A GAN's own `compile` signature (`bench_step` compiles it before
        # wrapping it, as `tests/support/guide_models.py`'s users do).
        target.compile(**kwargs)

    return model, compile, SHAPES["gan"]


def build(keras, name):
    """`(model, compile, row shape)` of the model named `name`."""
    if name == "gan":
        return _gan(keras)
    if name == "mlp":
        layers = [keras.Input((64,)),
                  keras.layers.Dense(256, activation="relu"),
                  keras.layers.Dense(256, activation="relu"),
                  keras.layers.Dense(10)]
    elif name == "dropout_mlp":
        # Random-heavy: two Dropout masks of 2048 per row (issue #40's
        # "Dropout-heavy MLP"), where exact randomness costs most.
        layers = [keras.Input((256,))]
        for _ in range(2):
            layers += [keras.layers.Dense(2048, activation="relu"),
                       keras.layers.Dropout(0.5, seed=1)]
        layers.append(keras.layers.Dense(10))
    elif name in ("convnet", "convnet_bn"):
        layers = _convnet(keras, name == "convnet_bn")
    else:
        raise ValueError(
            f"`model` must be one of {MODELS}. Received: model={name!r}")
    model = keras.Sequential(layers, name=name)
    return model, compile_keras(keras), SHAPES[name]


def data(name, shape, num_samples, seed=0):
    """`(x, y)` NumPy arrays; `y` is None for the GAN (images only)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, *shape), dtype=np.float32)
    if name in OWN_STEP:
        return x, None
    return x, rng.integers(0, 10, size=(num_samples,)).astype("int32")
