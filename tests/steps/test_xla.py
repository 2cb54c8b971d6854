"""XLA per replica (`steps/_xla.py`): exact, really compiled, said when not.

With the model compiled with `jit_compile=True`, each replica's forward
pass, loss and gradients run as one XLA function; MirroredModel must equal
one device running XLA within 1e-5, on both paths, with empty shards.
"""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from support import helpers
from support.helpers import once

import keras_mirror

TOL = 1e-5
SIZES = (5, 1, 2, 3)  # 4 replicas: 2/1/1/1, 1/0/0/0, 1/1/0/0, 1/1/1/0
# The convnet's Dropout draws the global batch's random numbers, whose
# shape XLA needs at compile time: each global batch size is compiled again
# on every device (measured: 4.5 CPU-s a size on 4 replicas, 1.4 on one
# device), although its shard shapes were compiled before. So it runs on 2
# replicas and two sizes, which still give uneven shards and an empty one;
# the dense model runs on all 4.
CONV_SIZES = (5, 1)  # 2 replicas: 3/2, 1/0
CONV_REPLICAS = 2
ROOT = str(helpers.ROOT)


def _dense():
    return keras.Sequential([
        keras.Input((6,)),
        layers.Dense(16, activation="relu", kernel_regularizer="l2"),
        layers.Dense(3)])


def _convnet():
    return keras.Sequential([
        keras.Input((8, 8, 3)), layers.Conv2D(4, 3, activation="relu"),
        layers.MaxPooling2D(), layers.Flatten(),
        layers.Dropout(0.3, seed=3), layers.Dense(3)])


def _data(shape, sizes=SIZES):
    rng = np.random.default_rng(0)
    rows = sum(sizes)
    x = rng.normal(size=(rows,) + shape).astype("float32")
    y = rng.normal(size=(rows, 3)).astype("float32")
    ds, start = None, 0
    for size in sizes:
        part = tf.data.Dataset.from_tensors(
            (x[start:start + size], y[start:start + size]))
        ds = part if ds is None else ds.concatenate(part)
        start += size
    return ds


def _train(build, shape, wrap, execution, epochs=2, devices=None):
    keras.utils.set_random_seed(7)
    data = _data(shape, CONV_SIZES if build is _convnet else SIZES)
    model = build()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    if wrap:
        mirrored = keras_mirror.MirroredModel(model, devices=devices,
                                              execution=execution)
        mirrored.fit(data, epochs=epochs, verbose=0)
        assert mirrored._step_state.xla_last is not None
    else:
        model.fit(data, epochs=epochs, verbose=0)
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize("execution", ["strategy"])
@pytest.mark.parametrize("build,shape", [(_dense, (6,)),
                                         (_convnet, (8, 8, 3))])
def test_xla_equals_one_device_with_xla(build, shape, execution, cpus,
                                       one_device):
    one = once(one_device, build.__name__,
               lambda: _train(build, shape, False, execution))
    devices = cpus[:CONV_REPLICAS] if build is _convnet else cpus
    mirrored = _train(build, shape, True, execution, devices=devices)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(one, mirrored))
    assert diff < TOL


@pytest.mark.parametrize("execution", ["strategy"])
def test_one_trace_serves_every_replica(execution):
    model = _dense()
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    mirrored = keras_mirror.MirroredModel(model, execution=execution)
    x, y = np.ones((10, 6), "float32"), np.ones((10, 3), "float32")
    mirrored.fit(x, y, batch_size=10, verbose=0)
    assert len(mirrored.devices) == 4
    # One trace (`steps/_one_trace`), compiled once per device by XLA.
    assert mirrored._step_state.xla_last.experimental_get_tracing_count() == 1


# The four runs below share one fresh process (one TensorFlow start-up):
# each fits under its own execution path and `jit_compile`, and the
# modules XLA dumped during it are its own.
_SCRIPT = """
import json, os, sys
import keras, numpy as np
import keras_mirror
keras_mirror.logical_cpus(4)
from keras import layers
dump = sys.argv[1]
seen, modules = set(), {}
for execution, jit in json.loads(sys.argv[2]):
    model = keras.Sequential([keras.Input((6,)), layers.Dense(8),
                              layers.Dense(3)])
    model.compile("sgd", "mse", jit_compile=jit)
    x, y = np.ones((10, 6), "float32"), np.ones((10, 3), "float32")
    keras_mirror.MirroredModel(model, execution=execution).fit(
        x, y, batch_size=10, verbose=0)
    names = set(os.listdir(dump)) if os.path.isdir(dump) else set()
    modules[f"{execution}-{jit}"] = sorted(names - seen)
    seen |= names
print(json.dumps(modules))
"""
# Uncompiled runs first: a module they dumped could not be an earlier run's.
_RUNS = [("strategy", False), ("strategy", "auto"), ("strategy", True)]


@pytest.fixture(scope="module")
def compiled_modules(tmp_path_factory):
    """{"<execution>-<jit_compile>": names of the XLA modules compiled}."""
    dump = tmp_path_factory.mktemp("xla") / "dump"
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}",
               PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", helpers.lean(_SCRIPT),
                           str(dump),
                           json.dumps(_RUNS)],
                          env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    pattern = re.compile(r"module_\d+\.a_inference_\w+?_\d+")
    return {run: {m.group(0) for m in map(pattern.match, files) if m}
            for run, files in names.items()}


@pytest.mark.parametrize("execution", ["strategy"])
def test_the_replica_function_is_compiled_by_xla(compiled_modules,
                                                 execution):
    modules = compiled_modules[f"{execution}-True"]
    # One module per replica device (XLA compiles per device and shape).
    assert len([m for m in modules if "_inference_work_" in m]) == 4


def test_no_xla_when_off_or_auto_on_cpu(compiled_modules):
    # Keras's "auto" is False on a CPU-only machine, as on one device.
    assert compiled_modules["strategy-False"] == set()
    assert compiled_modules["strategy-auto"] == set()


def test_auto_follows_keras_single_device_rule(monkeypatch):
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    listed = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: listed(kind) + [gpu])
    model = _dense()
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    assert model.jit_compile is True


def test_own_step_warns_once_that_it_runs_uncompiled(cpus):
    from support.helpers import own_step_model

    model = own_step_model(features=4)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    mirrored = keras_mirror.MirroredModel(model)
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    with pytest.warns(UserWarning, match=r"without XLA because the model "
                      r"has its own `train_step`.*Received: jit_compile="
                      r"True"):
        mirrored.fit(x, y, batch_size=8, epochs=2, verbose=0)


@pytest.mark.parametrize("execution", ["strategy"])
def test_masked_output_warns_and_stays_exact(execution, one_device):
    def build():
        return keras.Sequential([
            keras.Input((5, 2)), layers.Masking(0.0),
            layers.Dense(3)])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, 5, 2)).astype("float32")
    x[:, 3:] = 0.0
    y = rng.normal(size=(11, 5, 3)).astype("float32")

    def train(wrap):
        keras.utils.set_random_seed(3)
        model = build()
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        if wrap:
            mirrored = keras_mirror.MirroredModel(model, execution=execution)
            with pytest.warns(UserWarning, match="carries a Keras mask"):
                mirrored.fit(x, y, batch_size=6, verbose=0)
        else:
            model.fit(x, y, batch_size=6, verbose=0)
        return [w.numpy() for w in model.weights]

    one = once(one_device, "masked", lambda: train(False))
    assert max(float(np.abs(a - b).max())
               for a, b in zip(one, train(True))) < TOL


@pytest.mark.parametrize("execution", ["strategy"])
def test_sparse_gradients_of_an_embedding_with_xla(execution, one_device):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (13, 5))
    y = rng.normal(size=(13, 2)).astype("float32")

    def train(wrap):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((5,), dtype="int32"), layers.Embedding(20, 4),
            layers.GlobalAveragePooling1D(), layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
        target = keras_mirror.MirroredModel(
            model, execution=execution) if wrap else model
        target.fit(x, y, batch_size=5, epochs=2, verbose=0, shuffle=False)
        return model.get_weights()

    one = once(one_device, "embedding", lambda: train(False))
    assert max(float(np.abs(a - b).max())
               for a, b in zip(one, train(True))) < TOL
