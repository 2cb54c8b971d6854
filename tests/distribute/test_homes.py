"""`distribute/_homes.py`: no second copy of the weights while training.

On the `"strategy"` path the user's variables train on distributed
backings; the idle single-device backings are released meanwhile, and made
again from the trained values when the wrapper call ends.
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mirror
from keras_mirror import _compat


def _model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(16, 6)).astype("float32"),
            rng.normal(size=(16, 2)).astype("float32"))


class _Alive(keras.callbacks.Callback):
    """Counts the single-device backings still alive at each batch end."""

    def __init__(self, refs):
        super().__init__()
        self.refs, self.alive = refs, []

    def on_train_batch_end(self, batch, logs=None):
        gc.collect()
        self.alive.append(sum(r() is not None for r in self.refs))


def test_single_device_backings_are_released_while_mirrored(cpus):
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)  # the user's own traced step
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    mirrored.fit(x[:8], y[:8], batch_size=8, verbose=0)  # slots made
    refs = [weakref.ref(_compat.backing(v))
            for v in model.weights + model.optimizer.variables]
    alive = _Alive(refs)
    mirrored.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[alive])
    assert alive.alive == [0, 0, 0, 0]
    for v in model.weights:
        assert not isinstance(_compat.backing(v),
                              keras_mirror_distributed())


def keras_mirror_distributed():
    import tensorflow as tf

    return tf.distribute.DistributedValues


def test_the_users_fit_trains_on_the_new_backings(cpus):
    x, y = _data()
    keras.utils.set_random_seed(1)
    reference = _model()
    reference.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    keras.utils.set_random_seed(1)
    model = _model()
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    mirrored.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    diff = max(float(np.abs(a - b).max())
               for a, b in zip(reference.get_weights(), model.get_weights()))
    assert diff < 1e-5


class _Swaps(keras.callbacks.Callback):
    """Records the sum of the first kernel at each epoch's end, after
    `SwapEMAWeights` (listed before it) put the averages in the model."""

    def __init__(self):
        super().__init__()
        self.sums = []

    def on_epoch_end(self, epoch, logs=None):
        self.sums.append(float(np.sum(self.model.get_weights()[0])))


@pytest.mark.parametrize("execution", ["strategy"])
def test_swap_ema_weights_and_the_final_overwrite_as_on_one_device(
        cpus, execution):
    """`SwapEMAWeights` swaps each variable with its average through the
    optimizer's strategy (on the `"strategy"` path it crashed: "tuple
    indices must be integers or slices, not MirroredVariable"): the
    validation losses (on the averages), what a later callback sees at each
    epoch end, and the final weights (EMA's overwrite) equal one device's,
    on every replica's copy."""
    x, y = _data()

    def run(wrap):
        keras.utils.set_random_seed(2)
        model = _model()
        model.compile(optimizer=keras.optimizers.Adam(
            0.05, use_ema=True, ema_momentum=0.5), loss="mse")
        target = model
        if wrap:
            target = keras_mirror.MirroredModel(model, devices=cpus,
                                                execution=execution)
        seen = _Swaps()
        history = target.fit(
            x[:13], y[:13], batch_size=5, epochs=3, verbose=0,
            validation_data=(x[13:], y[13:]),
            callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
                       seen])
        return model, target, history.history, seen.sums

    reference, _, ref_history, ref_sums = run(wrap=False)
    model, mirrored, history, sums = run(wrap=True)
    np.testing.assert_allclose(history["val_loss"], ref_history["val_loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-5)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The averages differ from the trained weights: the swap is visible.
    assert abs(ref_history["val_loss"][-1] - ref_history["loss"][-1]) > 1e-4
    if execution == "strategy":
        for v in model.weights:
            entry = mirrored._homes._entries[id(v)]
            copies = mirrored._strategy.experimental_local_results(entry[2])
            for copy in copies:
                np.testing.assert_allclose(np.array(copy), v.numpy(),
                                           rtol=1e-6)
        assert model.optimizer._distribution_strategy is \
            tf.distribute.get_strategy()
