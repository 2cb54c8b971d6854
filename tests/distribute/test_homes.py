"""`distribute/_homes.py`: no second copy of the weights while training.

On the `"strategy"` path the user's variables train on distributed
backings; the idle single-device backings are released meanwhile, and made
again from the trained values when the wrapper call ends.
"""

import gc
import weakref

import keras
import numpy as np

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
