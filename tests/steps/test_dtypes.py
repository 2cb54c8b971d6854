"""The wrapper's own arithmetic runs in the model's dtype.

A float64 model (`keras.config.set_floatx("float64")`) trains on the
replicas as on one device to float64 precision: the shares `b_r / B`, the
loss weighting, the regularisation and the gradients' share weighting are
computed in float64 (shares rounded once from float64 in a float32 model,
so float32 training is unchanged). Shares such as 7/30 are not exact in
float32, which is how a float32 step on the way shows up: one SGD step with
learning rate 1 then differs from one device by ~1e-8 relative to the
update, where float64 arithmetic agrees to ~1e-15.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")
    try:
        yield
    finally:
        keras.config.set_floatx("float32")


def _model(regularize):
    keras.utils.set_random_seed(3)
    reg = keras.regularizers.L2(0.01) if regularize else None
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=reg),
        keras.layers.Dense(3),
    ])


def _data(rows=30):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(rows, 6))
    y = rng.normal(size=(rows, 3))
    sw = rng.uniform(0.1, 2.0, size=(rows,))
    return x, y, sw


LOSSES = {
    "mean": lambda: "mse",
    "sum": lambda: keras.losses.MeanSquaredError(reduction="sum"),
    "weighted_mean": lambda: keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"),
}


def _relative_update_difference(before, reference, got):
    """max |got - reference| / max |reference - before|, over the weights."""
    update = max(float(np.max(np.abs(r - b)))
                 for b, r in zip(before, reference))
    diff = max(float(np.max(np.abs(g - r))) for r, g in zip(reference, got))
    return diff / update


def _train(make, loss, cpus, x, y, sw, batch_size, mirrored):
    model = make()
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss())
    before = [np.asarray(w) for w in model.get_weights()]
    target = keras_mirror.MirroredModel(model, devices=cpus) if mirrored \
        else model
    target.fit(x, y, sample_weight=sw, batch_size=batch_size, epochs=1,
               shuffle=False, verbose=0)
    return before, [np.asarray(w) for w in model.get_weights()], model


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("regularize", [False, True])
def test_a_float64_model_agrees_with_one_device_to_float64_precision(
        loss, regularize, cpus, float64):
    # 30 rows split 8, 8, 7, 7: the shares 7/30 and 8/30 are not exact
    # in float32. Then batches of 13 (4, 3, 3, 3) and 4 (1, 1, 1, 1).
    x, y, sw = _data(47)
    for batch_size in (30, 17):
        before, reference, ref_model = _train(
            lambda: _model(regularize), LOSSES[loss], cpus, x, y, sw,
            batch_size, mirrored=False)
        _, got, model = _train(lambda: _model(regularize), LOSSES[loss],
                               cpus, x, y, sw, batch_size, mirrored=True)
        assert all(w.dtype == np.float64 for w in got)
        relative = _relative_update_difference(before, reference, got)
        print(f"{loss} reg={regularize} batch {batch_size}: {relative:.3g}")
        assert relative < 1e-12


def test_a_float32_model_is_unchanged_by_float64_shares(cpus):
    """Shares rounded once from float64 are the float32 shares: a float32
    model still agrees with one device within float32 rounding."""
    x, y, sw = (a.astype("float32") for a in _data(47))
    before, reference, _ = _train(lambda: _model(True), LOSSES["mean"],
                                  cpus, x, y, sw, 30, mirrored=False)
    _, got, model = _train(lambda: _model(True), LOSSES["mean"], cpus, x, y,
                           sw, 30, mirrored=True)
    assert all(w.dtype == np.float32 for w in got)
    assert _relative_update_difference(before, reference, got) < 1e-5


class GuideStep(keras.Model):
    """The Keras guide's own `train_step`, in the model's dtype."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_an_own_step_in_float64_agrees_to_float64_precision(cpus, float64):
    x, y, _ = _data(47)
    results = []
    for mirrored in (False, True):
        keras.utils.set_random_seed(3)
        model = GuideStep()
        model(x[:1])
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        before = [np.asarray(w) for w in model.get_weights()]
        target = keras_mirror.MirroredModel(model, devices=cpus) \
            if mirrored else model
        target.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
        results.append([np.asarray(w) for w in model.get_weights()])
    relative = _relative_update_difference(before, *results)
    print(f"own step float64: {relative:.3g}")
    assert relative < 1e-12
