"""A draw's row order, read from the graph (`_row_order`), on replicas.

A draw of `k * b_r` rows made from a Reshape of the batch (`(b, T, d) ->
(b * T, d)`) is example-major: each replica takes one run of one device's
rows. Concatenated blocks of the batch (a GAN's) stay stacked; a leading
dimension whose making cannot be read is drawn as stacked blocks with one
warning. Weights after training through `MirroredModel` on 2 and 4
replicas (uneven and empty shards) are one device's.
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from keras import ops
from support.helpers import max_diff

import keras_mirror
from keras_mirror.steps import _random
from keras_mirror.steps import _row_order

T, D = 3, 5
TOL = 1e-6
UNREAD = "keras-mirror cannot read how the rows"
# (replicas, rows, batch): 7, 7, 5 rows split 4/3, 4/3, 3/2 on 2 replicas;
# 7, 7, 7, 1 rows split 2/2/2/1 and 1/0/0/0 (empty shards) on 4.
RUNS = [(2, 19, 7), (4, 22, 7)]


class ToRows(layers.Layer):
    """`(b, T, D) -> (b * T, D)`: each example's rows, one after another."""

    def call(self, x):
        return ops.reshape(x, (-1, D))


class FromRows(layers.Layer):
    def call(self, x):
        return ops.reshape(x, (-1, T * D))


class RowNoise(layers.Layer):
    """Adds `keras.random.normal(tf.shape(rows))` to the reshaped rows."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(7)

    def call(self, x, training=False):
        rows = ops.reshape(x, (-1, D))
        if training:
            rows = rows + 0.3 * keras.random.normal(tf.shape(rows),
                                                    seed=self.seed)
        return ops.reshape(rows, (-1, T * D))


def _reshape_dropout(jit=False):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((T, 4)), layers.Dense(D), ToRows(), layers.Dropout(0.4),
        FromRows(), layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=jit)
    return model


def _normal_noise(jit=False):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((T, 4)), layers.Dense(D),
                              RowNoise(), layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=jit)
    return model


class Gan(keras.Model):
    """An own step drawing for `concatenate([real, fake])`: stacked."""

    def __init__(self):
        super().__init__()
        self.seed = keras.random.SeedGenerator(4)
        self.dense = layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        b = ops.shape(x)[0]
        both = ops.concatenate([x, x[:, ::-1]])
        noise = keras.random.normal(tf.shape(both), seed=self.seed)
        labels = ops.concatenate([ops.ones((b, 1)), ops.zeros((b, 1))])
        labels = labels + 0.05 * keras.random.uniform((2 * b, 1),
                                                      seed=self.seed)
        with tf.GradientTape() as tape:
            pred = self(both + 0.1 * noise)
            loss = ops.mean((pred - labels) ** 2) + ops.mean(
                (self(x) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _gan(jit=False):
    keras.utils.set_random_seed(1)
    model = Gan()
    model(np.zeros((1, 6), "float32"))
    model.compile("sgd")
    return model


def _data(rows, shape):
    rng = np.random.default_rng(3)
    return (rng.normal(size=(rows,) + shape).astype("float32"),
            rng.normal(size=(rows, 1)).astype("float32"))


def _diff(build, devices, rows, batch, shape=(T, 4), jit=False):
    """Max weight difference of `MirroredModel` training from one device's,
    with no row-order warning (the loss-kind probe included)."""
    x, y = _data(rows, shape)
    single = build(jit)
    single.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model = build(jit)
    mirrored = keras_mirror.MirroredModel(model, devices=devices)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=UNREAD)
        mirrored.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                     verbose=0)
    if jit:
        assert mirrored._step_state.xla_last is not None
    return max_diff(single.get_weights(), model.get_weights())


@pytest.mark.parametrize("n,rows,batch", RUNS)
def test_reshape_then_dropout_trains_as_on_one_device(cpus, n, rows, batch):
    """Was 4.7e-3 (2 replicas) and 6.8e-3 (4) with the rows read as stacked
    blocks; the probe of these own layers refused the loss as neither a
    mean nor a sum (the doubled batch drew a fresh mask)."""
    assert _diff(_reshape_dropout, cpus[:n], rows, batch) < TOL


@pytest.mark.parametrize("n,rows,batch", RUNS)
def test_a_normal_draw_of_reshaped_rows_trains_as_on_one_device(cpus, n,
                                                                rows, batch):
    """`keras.random.normal(tf.shape(rows))`: was 3.4e-3 and 5.7e-3."""
    assert _diff(_normal_noise, cpus[:n], rows, batch) < TOL


def test_stacked_gan_draws_train_as_on_one_device(cpus):
    """`tf.shape(concatenate([real, fake]))` and `(2 * b, 1)` stay stacked
    blocks of the batch (4 replicas, an empty shard)."""
    assert _diff(_gan, cpus, 22, 7, shape=(6,)) < TOL


def _time_distributed(jit=False):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((T, 4)), layers.TimeDistributed(layers.Dropout(0.4)),
        layers.TimeDistributed(layers.Dense(D)), layers.Flatten(),
        layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=jit)
    return model


@pytest.mark.parametrize("n,rows,batch", RUNS)
def test_time_distributed_dropout_trains_as_on_one_device(cpus, n, rows,
                                                          batch):
    """Keras's `TimeDistributed` draws for `transpose(x)[t]`, the batch's
    rows at one time step: read through the Transpose, no warning (`_diff`
    fails on one; before, it warned of an unread Transpose)."""
    assert _diff(_time_distributed, cpus[:n], rows, batch) < TOL


def _recurrent(jit=False):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((T, 4)),
        layers.Bidirectional(layers.LSTM(4, dropout=0.2, return_sequences=True,
                                         recurrent_dropout=0.1)),
        layers.TimeDistributed(layers.Dense(D)), layers.GaussianDropout(0.1),
        layers.GRU(4, dropout=0.2), layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=jit)
    return model


def test_recurrent_layers_draw_as_on_one_device_without_a_warning(cpus):
    """Dropout of an RNN's time-major stacked outputs (a TensorList) and
    of `TimeDistributed`'s stacked steps: their rows are read, no warning
    (`_diff` fails on one)."""
    assert _diff(_recurrent, cpus, 22, 7) < TOL


def test_reshape_then_dropout_under_xla_trains_as_on_one_device(cpus):
    """The compiled step gathers its run of one device's rows: was 8.8e-3
    (4 replicas, an empty shard)."""
    assert _diff(_reshape_dropout, cpus, 22, 7, jit=True) < TOL


def test_the_stacked_reading_would_differ(cpus, monkeypatch):
    """What the tests above guard against: the reshaped rows read as
    stacked blocks train away from one device."""
    monkeypatch.setattr(_row_order, "of_shape",
                        lambda shape: (_row_order.STACKED, None))
    assert _diff(_reshape_dropout, cpus, 22, 7) > 1e-4


class Orders(keras.Model):
    """A `predict_step` that reads its shapes' row order while the replica
    step is traced."""

    seen = {}

    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(D)

    def call(self, x):
        return self.dense(x)

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        b = ops.shape(x)[0]
        h = self(x)                       # (b, T, D): a tensordot
        shapes = {
            "batch": ops.shape(h),
            "reshaped": tf.shape(ops.reshape(h, (-1, D))),
            "repeated": tf.shape(tf.repeat(x, 2, axis=0)),
            "concatenated": tf.shape(ops.concatenate([h, h])),
            "two_b": (2 * b, 1),
            "tiled": tf.shape(tf.tile(x, [3, 1, 1])),
            "time_major": tf.shape(tf.reshape(
                tf.transpose(h, [1, 0, 2]), (-1, D))),
            "stacked_reshaped": tf.shape(tf.reshape(
                ops.concatenate([h, h]), (-1, D))),
            "by_hand": (b * tf.shape(x)[1], D),
            # `TimeDistributed`'s step: one time step of the batch's rows.
            "time_step": tf.shape(tf.transpose(h, [1, 0, 2])[1]),
            "time_slice": tf.shape(tf.transpose(h, [1, 0, 2])[1:]),
            # Its static-length output: the steps stacked, transposed back.
            "steps_stacked": tf.shape(tf.transpose(
                tf.stack([h[:, 0], h[:, 1]]), [1, 0, 2])),
            "expanded": tf.shape(tf.transpose(
                tf.expand_dims(h, 0), [2, 1, 0, 3])[0]),
        }
        for key, shape in shapes.items():
            Orders.seen[key] = _row_order.of_shape(shape)
        Orders.seen["rows"] = _row_order.of_rows(ops.reshape(h, (-1, D)))
        return h


def test_the_replica_step_reads_each_draws_row_order(cpus):
    model = Orders()
    x = np.zeros((6, T, 4), "float32")
    model(x[:1])
    keras_mirror.MirroredModel(model, devices=cpus[:2]).predict(
        x, batch_size=6, verbose=0)
    major, stacked = _row_order.EXAMPLE_MAJOR, _row_order.STACKED
    unknown = _row_order.UNKNOWN
    assert Orders.seen == {
        "batch": (stacked, None),
        "reshaped": (major, None),
        "repeated": (major, None),
        "concatenated": (stacked, None),
        "two_b": (stacked, None),
        "tiled": (stacked, None),
        "time_major": (unknown, "Reshape"),   # of a time-major tensor
        "stacked_reshaped": (unknown, "Reshape"),
        "by_hand": (unknown, "Mul"),     # T dynamic: `b * T` unread
        "time_step": (stacked, None),
        "time_slice": (unknown, "Reshape"),
        "steps_stacked": (stacked, None),
        "expanded": (stacked, None),   # one time step: the batch's rows
        "rows": (major, None),
    }


class ByHand(layers.Layer):
    """Noise of shape `(b * T, 4)` written by hand, `T` dynamic."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed = keras.random.SeedGenerator(2)

    def call(self, x, training=False):
        if not training:
            return x
        shape = tf.shape(x)
        noise = keras.random.normal((shape[0] * shape[1], 4), seed=self.seed)
        return x + 0.1 * ops.reshape(noise, shape)


def test_an_unread_row_order_warns_once(cpus):
    """One warning naming the draw and the op, over two fits that trace the
    step again (other lengths); none from the loss-kind probe, which runs
    this own layer before the first step."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((None, 4)), ByHand(),
                              layers.GlobalAveragePooling1D(),
                              layers.Dense(1)])
    model.compile("sgd", "mse")
    mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
    expected = _random.UNREAD_ORDER.format(name="normal", where="Mul")
    assert expected.startswith(
        "keras-mirror cannot read how the rows of the `keras.random.normal` "
        "draw in the replica step were made (its leading dimension comes "
        "from a `Mul` op), so it reads them as stacked blocks of the batch")
    assert expected.endswith(
        "Received: draw `normal` with its leading dimension from `Mul`")
    with pytest.warns(UserWarning, match=re.escape(expected)) as record:
        for length in (3, 5):
            x, y = _data(12, (length, 4))
            mirrored.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert sum(UNREAD in str(w.message) for w in record) == 1


class ReshapedDraws(keras.Model):
    """A `predict_step` returning draws for `T` rows an example."""

    def __init__(self):
        super().__init__()
        self.seed = keras.random.SeedGenerator(9)
        self.dense = layers.Dense(D)

    def call(self, x):
        return self.dense(x)

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        rows = ops.reshape(self(x), (-1, D))               # (b * T, D)
        noise = keras.random.uniform(ops.shape(rows), seed=self.seed)
        picks = keras.random.categorical(rows, 2, seed=self.seed)
        return {"noise": ops.reshape(noise, (-1, T * D)),
                "picks": ops.reshape(ops.cast(picks, "float32"), (-1, 2 * T))}


def test_reshaped_draws_are_one_devices_rows(cpus):
    """Uniform and categorical draws of reshaped rows, bit for bit, on 4
    replicas (batches 10, 10, 3: an empty shard)."""
    x = np.random.default_rng(5).normal(size=(23, T, 4)).astype("float32")

    def draws(wrap):
        keras.utils.set_random_seed(0)
        model = ReshapedDraws()
        model(x[:1])
        target = keras_mirror.MirroredModel(model, devices=cpus) \
            if wrap else model
        return target.predict(x, batch_size=10, verbose=0)

    one, many = draws(False), draws(True)
    for key in one:
        np.testing.assert_array_equal(many[key], one[key], err_msg=key)
