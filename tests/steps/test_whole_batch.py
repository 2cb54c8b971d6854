"""Whole-batch losses in a model's own `train_step`.

The warning of `keras_mirror/steps/_mixing.py`, and the exact way round it.

With `replica_context().all_gather`, SimCLR's NT-Xent trains as on one
device on 4 and 2 replicas, uneven and empty shards included. Without it,
the step's `[2b, 2b]` similarity matrix is the shard's only, and the first
step warns once; exact steps (a GAN, a VAE, BatchNormalization, the
gathered NT-Xent, the built-in step) do not warn.
"""

import importlib.util
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from support import guide_models
from support import helpers
from support.helpers import max_diff

import keras_mirror
from keras_mirror.steps import _mixing

TOL = 1e-5
# 26 rows in batches of 8: 8, 8, 8, 2. On 4 replicas 2/2/2/2, last 1/1/0/0
# (two empty shards); on 2 replicas 4/4, last 1/1.
NT_XENT = ["--loss", "nt-xent", "--rows", "26", "--batch-size", "8"]
PREFIX = "The model's own `train_step` computes "


def _example():
    spec = importlib.util.spec_from_file_location(
        "contrastive", helpers.EXAMPLES / "contrastive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ours(caught):
    """The whole-batch warnings among `caught`."""
    return [str(w.message) for w in caught
            if str(w.message).startswith(PREFIX)]


def _recording(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, _ours(caught)


@pytest.mark.parametrize("replicas", [4, 2])
def test_nt_xent_with_all_gather_trains_as_on_one_device(cpus, replicas):
    example = _example()
    args = example.parse_args(NT_XENT)
    single, h1 = example.train(args, None, True)
    (gathered, h2), warned = _recording(example.train, args,
                                        cpus[:replicas], True)
    assert max_diff(single.get_weights(), gathered.get_weights()) < TOL
    np.testing.assert_allclose(h2.history["loss"], h1.history["loss"],
                               rtol=1e-5)
    assert warned == []


def test_nt_xent_on_the_shard_warns_once_and_differs(cpus):
    example = _example()
    args = example.parse_args(NT_XENT)
    single, _ = example.train(args, None, True)
    (local, _), warned = _recording(example.train, args, cpus, False)
    assert max_diff(single.get_weights(), local.get_weights()) > 0.1
    assert warned == [_mixing.message("MatMul", "(2b, 2b)")]
    assert "`keras_mirror.replica_context().all_gather(...)`" in warned[0]
    assert 'docs/exactness.md, "Whole-batch losses"' in warned[0]


# -- steps that mix a shard's rows -------------------------------------------


def _similarity(q, v, y):
    """CLIP-style: row i's match is row i of the other tower."""
    logits = keras.ops.matmul(q, keras.ops.transpose(v))
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(
        keras.ops.arange(keras.ops.shape(q)[0]), logits, from_logits=True))


def _batch_softmax(q, v, y):
    """Each item's softmax over the batch's queries (axis 0)."""
    scores = keras.ops.softmax(tf.einsum("id,jd->ij", q, v), axis=0)
    return -keras.ops.mean(keras.ops.log(tf.linalg.diag_part(scores)))


def _label_mask(q, v, y):
    """Supervised contrastive: the pairs of rows that share a label."""
    same = tf.cast(tf.equal(y[:, None], y[None, :]), q.dtype)
    return keras.ops.mean(same * tf.reduce_sum(q * v, axis=1))


class TwoTower(keras.Model):
    """Queries and items embedded by two Dense layers; `loss_fn(q, v, y)`.
    """

    def __init__(self, loss_fn, **kwargs):
        super().__init__(**kwargs)
        self.queries = keras.layers.Dense(4)
        self.items = keras.layers.Dense(4)
        self.loss_fn = loss_fn

    def call(self, x):
        return self.queries(x) + self.items(x)  # builds both

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(self.queries(x), self.items(x), y)
        variables = self.trainable_weights
        self.optimizer.apply_gradients(
            zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


def _fit_two_tower(cpus, loss_fn):
    model = TwoTower(loss_fn)
    model(np.zeros((1, 6), "float32"))
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(26, 6)).astype("float32")
    y = (np.arange(26) % 3).astype("float32")
    mirrored.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)


@pytest.mark.parametrize("loss_fn, name, shape", [
    (_similarity, "MatMul", "(b, b)"),
    (_batch_softmax, "einsum/Einsum", "(b, b)"),
    (_label_mask, "Equal", "(b, b)"),
], ids=["similarity", "batch_softmax", "label_mask"])
def test_a_step_that_mixes_its_rows_warns_once(cpus, loss_fn, name, shape):
    _, warned = _recording(_fit_two_tower, cpus, loss_fn)
    assert warned == [_mixing.message(name, shape)]


# -- exact steps: silent -----------------------------------------------------


def test_one_replica_does_not_warn(cpus):
    # Its shard is the whole batch: the similarity matrix is one device's.
    _, warned = _recording(_fit_two_tower, cpus[:1], _similarity)
    assert warned == []



class OwnBatchNorm(keras.Model):
    """BatchNormalization in the Keras guide's own `train_step`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8),
            keras.layers.BatchNormalization(), keras.layers.Dense(3)])

    def call(self, x, training=False):
        return self.body(x, training=training)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        variables = self.trainable_weights
        self.optimizer.apply_gradients(
            zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


def _guide(builder):
    def fit(cpus):
        model, compile_kwargs, (x, y) = builder()
        mirrored = keras_mirror.MirroredModel(model, devices=cpus)
        mirrored.compile(**compile_kwargs)
        mirrored.fit(x, y, batch_size=guide_models.BATCH, epochs=1,
                     shuffle=False, verbose=0)
    return fit


def _batchnorm(cpus):
    x, y, _ = helpers.data(26)
    model = OwnBatchNorm()
    model(x[:1])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1))
    mirrored.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def _built_in(cpus):
    x, y, _ = helpers.data(26)
    mirrored = keras_mirror.MirroredModel(helpers.mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("fit", [
    _guide(guide_models.gan), _guide(guide_models.vae), _batchnorm,
    _built_in,
], ids=["gan", "vae", "batchnorm", "built_in"])
def test_exact_steps_do_not_warn(cpus, fit):
    # The gathered NT-Xent: `test_nt_xent_with_all_gather_...` above.
    _, warned = _recording(fit, cpus)
    assert warned == []


def _fixed_rows(q, v, y):
    """A step that fixes its shard's rows (2) in the graph."""
    q = tf.ensure_shape(q, [2, 4])
    return keras.ops.mean(keras.ops.square(q - v))


def test_a_step_the_check_cannot_trace_is_logged_not_warned(cpus, caplog):
    # 8 rows a batch: shards of 2 rows, which the step's shape check
    # accepts; the scan's prime row count does not.
    caplog.set_level("INFO", logger="keras_mirror")
    model = TwoTower(_fixed_rows)
    model(np.zeros((1, 6), "float32"))
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    _, warned = _recording(mirrored.fit, x, x[:, 0], 8, 1)
    assert warned == []
    logged = [r.getMessage() for r in caplog.records
              if "whole-batch" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].startswith(
        "keras-mirror could not check the model's own `train_step` for "
        "whole-batch tensors: ")
