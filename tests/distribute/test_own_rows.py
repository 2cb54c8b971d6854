"""Each replica trains on the rows it received: virtual shards, one path.

With `worker_input="shard"` a `tf.data` input is read in virtual shards and
handed to Keras as `tf.distribute`'s distributed dataset of this worker's
rows (in one process too): each replica's shard is the part it received, the
plan is the gathered row counts, and the batch itself is not gathered
(`keras_mirror/steps/_own_rows.py`). Here, one process with 4 replicas and 4
virtual shards of an in-memory input (`SHARD_HINT`, 38 rows of 10, 10, 9 and
9), global batches of 11, 11, 11, 4 and 1 (the last two leave 1 and 3
replicas with stand-ins): Dropout, global BatchNormalization, sample weights
and a model's own `train_step` train as plain Keras on the same global
batches (the one-process stream, read back), within 1e-5.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import max_diff

from keras_mirror import MirroredModel
from keras_mirror.distribute import _virtual_shards
from keras_mirror.steps import strategy

ROWS, BATCH, V, EPOCHS = 38, 11, 4, 2


def _data(weights):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    parts = (x, y, rng.uniform(0.5, 2, size=(ROWS,)).astype("float32")) \
        if weights else (x, y)
    return tf.data.Dataset.from_tensor_slices(parts).shard(
        tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT
    ).batch(BATCH)


class Own(keras.Model):
    """A tape step of its own (keras.io's "customizing fit" pattern)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.drop = keras.layers.Dropout(0.3, seed=3)
        self.out = keras.layers.Dense(2)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x, training=False):
        return self.out(self.drop(self.hidden(x), training=training))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True)
                                                   - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def _model(kind):
    keras.utils.set_random_seed(0)
    if kind == "own":
        model = Own()
        model(np.zeros((1, 6), "float32"))
        return model
    layers = [keras.layers.Dense(8, activation="tanh")]
    layers.append(keras.layers.Dropout(0.3, seed=3) if kind == "dropout"
                  else keras.layers.BatchNormalization())
    return keras.Sequential([keras.Input((6,)), *layers,
                             keras.layers.Dense(2)])


def _compile(model, kind):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=None if kind == "own" else "mse",
                  metrics=None if kind == "own" else ["mae"])


@pytest.mark.parametrize("kind, weights", [
    ("dropout", False), ("batchnorm", True), ("own", False)])
def test_replicas_train_on_their_own_rows_as_one_device(cpus, monkeypatch,
                                                        kind, weights):
    calls = []
    shards_of = strategy.ReplicaSteps._shards_of
    monkeypatch.setattr(strategy.ReplicaSteps, "_shards_of", lambda *a: (
        calls.append(1), shards_of(*a))[1])
    mirrored = MirroredModel(_model(kind), devices=cpus[:4],
                             worker_input="shard", virtual_shards=V)
    _compile(mirrored, kind)
    batches = list(_virtual_shards.fit_dataset(mirrored, _data(
        weights)).as_numpy_iterator())
    assert [len(b[0]) for b in batches] == [11, 11, 11, 4, 1]
    history = mirrored.fit(_data(weights), epochs=EPOCHS, verbose=0)
    assert calls  # the replicas' own rows, not a gathered batch

    reference = _model(kind)
    _compile(reference, kind)
    spec = tuple(tf.TensorSpec((None,) + b.shape[1:], b.dtype)
                 for b in batches[0])
    want = reference.fit(tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=spec), epochs=EPOCHS,
        verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy())
    assert max_diff(mirrored.model.get_weights(),
                    reference.get_weights()) < 1e-5
    if kind == "own":
        # Plain Keras's own-step tracker also counts the call that meets
        # the end of an input of unknown length (a `Mean` of a scalar: its
        # count does not depend on the data, so it runs before the end is
        # met; `iterations` likewise, which keras-mirror keeps as Keras
        # does); keras-mirror's replicas count real steps only.
        return
    for key in want.history:
        np.testing.assert_allclose(history.history[key], want.history[key],
                                   rtol=1e-5, atol=1e-6)
