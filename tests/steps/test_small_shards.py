"""Odd shards on oneDNN's CPU kernels: padded, and still one device's.

TF 2.21's oneDNN convolution backprop aborts the process (SIGABRT,
"corrupted size vs. prev_size"), segfaults or raises `AbortedError` on odd
batches through a strided 1x1 convolution, on one device too
(`docs/onednn.md`, `benchmarks/results/shard_shapes/conv_matrix.md`). A
replica meets such batches where one device may not: 14 rows on 4
replicas are shards of 4, 4, 3 and 3. Where oneDNN runs a model with a
convolution, keras-mirror pads each replica's shard to an even number of
rows with stand-in rows that count for nothing
(`keras_mirror/steps/_stand_in.py`).

The training runs in child processes with a timeout, so that an abort
fails the test instead of killing pytest; the one-device reference runs
with `TF_ENABLE_ONEDNN_OPTS=0`, since one device aborts on the same data
(its last batch has 3 rows).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import lean

from keras_mirror import _compat
from keras_mirror.steps import _reductions
from keras_mirror.steps import _stand_in

TOL = 1e-5
TIMEOUT = 120

# The issue's model, small: a ResNet with strided 3x3 convolutions and
# strided 1x1 shortcuts on 12x12 inputs, synchronized BatchNorm and
# Dropout; 59 rows in batches of 14 (shards 4/4/3/3, then 1/1/1/0).
_TRAIN = r'''
import json, sys
import numpy as np
mode, out = sys.argv[1], sys.argv[2]
import keras_mirror
if mode == "mirrored":
    keras_mirror.logical_cpus(4)
import keras
from keras import layers

keras.utils.set_random_seed(3)
inputs = keras.Input((12, 12, 3))
t = layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
t = layers.ReLU()(layers.BatchNormalization(synchronized=True)(t))
for filters in (8, 16):
    a = layers.Conv2D(filters, 3, strides=2, padding="same",
                      use_bias=False)(t)
    a = layers.ReLU()(layers.BatchNormalization(synchronized=True)(a))
    a = layers.Conv2D(filters, 3, padding="same", use_bias=False)(a)
    a = layers.BatchNormalization(synchronized=True)(a)
    s = layers.Conv2D(filters, 1, strides=2, use_bias=False)(t)
    s = layers.BatchNormalization(synchronized=True)(s)
    t = layers.ReLU()(layers.Add()([a, s]))
t = layers.Dropout(0.3)(layers.GlobalAveragePooling2D()(t))
model = keras.Model(inputs, layers.Dense(3)(t))
model.compile(keras.optimizers.SGD(0.05),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
rng = np.random.default_rng(0)
x = rng.normal(size=(59, 12, 12, 3)).astype("float32")
y = rng.integers(0, 3, size=(59,)).astype("int32")
target = model
if mode == "mirrored":
    target = keras_mirror.MirroredModel(model)
history = target.fit(x, y, batch_size=14, epochs=2, shuffle=False,
                     verbose=0)
np.savez(out, *model.get_weights())
print(json.dumps({k: [float(v) for v in vs]
                  for k, vs in history.history.items()}))
'''


def _start(mode, out, onednn_off):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    if onednn_off:
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    return subprocess.Popen(
        [sys.executable, "-c", lean(_TRAIN), mode, str(out)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process, what):
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"{what} did not finish in {TIMEOUT} s")
    assert process.returncode == 0, (
        f"{what} exited with {process.returncode}: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not _compat.onednn_enabled(),
                    reason="pads only where oneDNN's CPU kernels run")
def test_issue_resnet_trains_on_4_replicas_as_one_device(tmp_path):
    single = _start("single", tmp_path / "single.npz", onednn_off=True)
    mirrored = _start("mirrored", tmp_path / "mirrored.npz",
                      onednn_off=False)
    logs1 = _finish(single, "the one-device reference (oneDNN off)")
    logs2 = _finish(mirrored, "the mirrored fit on 4 replicas (oneDNN on)")
    with np.load(tmp_path / "single.npz") as a, \
            np.load(tmp_path / "mirrored.npz") as b:
        assert len(a.files) == len(b.files) == 37
        diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
    assert diff < TOL, diff
    assert sorted(logs1) == sorted(logs2) == ["accuracy", "loss"]
    for key in logs1:
        np.testing.assert_allclose(logs2[key], logs1[key], rtol=2e-5,
                                   atol=2e-6, err_msg=key)
