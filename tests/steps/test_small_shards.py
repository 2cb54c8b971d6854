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


# -- the padding plan (`_stand_in.bounds`, `_stand_in.shard`) ----------------

@pytest.mark.parametrize("sizes,multiple,starts,runs", [
    ([4, 4, 3, 3], 2, [0, 4, 8, 11], [4, 4, 4, 4]),
    ([1, 1, 1, 0], 2, [0, 1, 2, 0], [2, 2, 2, 2]),
    ([5, 0, 2, 7], 2, [0, 0, 5, 7], [6, 2, 2, 8]),
    ([1, 1, 1, 0], 1, [0, 1, 2, 0], [1, 1, 1, 1]),  # unpadded: as before
    ([3, 0], 4, [0, 0], [4, 4]),
])
def test_padding_plan(sizes, multiple, starts, runs):
    got_starts, got_runs = _stand_in.bounds(tf.constant(sizes), multiple)
    assert got_starts.numpy().tolist() == starts
    assert got_runs.numpy().tolist() == runs


def _rows_of(t):
    if isinstance(t, tf.SparseTensor):
        t = tf.sparse.to_dense(t)
    if isinstance(t, tf.RaggedTensor):
        t = t.to_tensor()
    return t.numpy()[:, 0].tolist()


@pytest.mark.parametrize("kind", ["dense", "sparse", "ragged"])
def test_padded_shards_are_the_shard_then_the_rows_after_it(kind):
    """A global batch of 3 on 4 replicas (1/1/1/0), padded to 2 rows each:
    each shard's real row first, then the next rows, wrapping around."""
    values = tf.constant([[10.0], [11.0], [12.0]])
    t = dict(dense=values, sparse=tf.sparse.from_dense(values),
             ragged=tf.RaggedTensor.from_tensor(values))[kind]
    starts, runs = _stand_in.bounds(tf.constant([1, 1, 1, 0]), 2)
    shards = [_rows_of(_stand_in.shard(t, starts[r], runs[r], 3))
              for r in range(4)]
    assert shards == [[10.0, 11.0], [11.0, 12.0], [12.0, 10.0],
                      [10.0, 11.0]]


def test_unpadded_cuts_to_the_shard_and_keeps_masks():
    t = tf.reshape(tf.range(12.0), [4, 3])
    mask = tf.constant([[True, False, True]] * 4)
    _compat.set_mask(t, mask)
    for rows, keep in ((3, 3), (1, 1), (0, 1)):
        x, y, none = _stand_in.unpadded((t, t[:, :1], None), rows)
        assert none is None
        assert x.numpy().tolist() == t.numpy()[:keep].tolist()
        assert y.numpy().tolist() == t.numpy()[:keep, :1].tolist()
        assert _compat.get_mask(x).numpy().tolist() == \
            mask.numpy()[:keep].tolist()


def _conv_model():
    return keras.Sequential([keras.Input((6, 6, 3)),
                             keras.layers.Conv2D(2, 1, strides=2),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


CPU4 = [f"/device:CPU:{i}" for i in range(4)]


@pytest.mark.parametrize("onednn,model,devices,extras,multiple", [
    (True, _conv_model, CPU4, (), 2),
    (False, _conv_model, CPU4, (), 1),  # TF_ENABLE_ONEDNN_OPTS=0
    (True, lambda: keras.Sequential([keras.Input((3,)),
                                     keras.layers.Dense(1)]), CPU4, (), 1),
    (True, _conv_model, ["/device:GPU:0", "/device:GPU:1"], (), 1),
    (True, _conv_model, CPU4, (_reductions.MEAN,), 1),  # an add_loss term
])
def test_row_multiple(monkeypatch, onednn, model, devices, extras, multiple):
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: onednn)
    reductions = _reductions.Reductions(extras=extras)
    assert _stand_in.row_multiple(model(), devices, reductions) == multiple


def test_row_multiple_says_once_why_it_does_not_pad(monkeypatch, caplog):
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    model = _conv_model()
    reductions = _reductions.Reductions(extras=(_reductions.SUM,))
    with caplog.at_level("WARNING", logger="keras_mirror"):
        for _ in range(2):
            assert _stand_in.row_multiple(model, CPU4, reductions) == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"keras-mirror does not pad odd shards of {model.name!r} to even "
        "ones on oneDNN's CPU kernels: its forward pass adds loss terms, "
        "which the stand-in rows would change. TF 2.21's oneDNN "
        "convolution backprop can abort on odd batches (docs/onednn.md); "
        "set TF_ENABLE_ONEDNN_OPTS=0 to avoid it."]


class OwnConvStep(keras.Model):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def call(self, x):
        return self.net(x)

    def train_step(self, data):
        return {}


@pytest.mark.parametrize("onednn,net,warned", [
    (True, _conv_model, True),
    (False, _conv_model, False),  # TF_ENABLE_ONEDNN_OPTS=0
    (True, lambda: keras.Sequential([keras.Input((3,)),
                                     keras.layers.Dense(1)]), False),
])
def test_an_own_step_with_convolutions_is_warned_when_wrapped(
        monkeypatch, caplog, cpus, onednn, net, warned):
    """A model's own `train_step` sees its shard as it is (no padding):
    where oneDNN runs its convolutions it is said when wrapping."""
    import keras_mirror

    monkeypatch.setattr(_compat, "onednn_enabled", lambda: onednn)
    model = OwnConvStep(net())
    with caplog.at_level("WARNING", logger="keras_mirror"):
        keras_mirror.MirroredModel(model, devices=cpus)
    said = [r.getMessage() for r in caplog.records
            if "its own `train_step`" in r.getMessage()]
    assert said == ([
        f"{model.name!r} has its own `train_step`, which keras-mirror runs "
        "on each replica's shard as it is: odd shards are not padded to "
        "even ones on oneDNN's CPU kernels, and TF 2.21's oneDNN "
        "convolution backprop can abort on odd batches (docs/onednn.md). "
        "Use global batches that give every replica an even number of "
        "rows, or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts."]
        if warned else [])
