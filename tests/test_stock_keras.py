"""Stock Keras under MirroredStrategy next to keras-mirror, on the same data.

Stock `fit` averages the replicas' local means, so a last batch split
unevenly (here 1025 rows, batch 64, 4 replicas: the last batch of 1 row is
split 1/0/0/0) moves the weights away from single-device training.
"""

import keras
import numpy as np
import tensorflow as tf
from helpers import max_diff

import keras_mirror


def _model():
    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((10,)),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(1)])


def test_stock_partial_batch_error_next_to_keras_mirror(cpus):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1025, 10)).astype("float32")
    y = rng.normal(size=(1025, 1)).astype("float32")
    kwargs = dict(batch_size=64, epochs=1, shuffle=False, verbose=0)

    reference = _model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, **kwargs)

    with tf.distribute.MirroredStrategy(cpus).scope():
        stock = _model()
        stock.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    stock.fit(x, y, **kwargs)

    mirrored = keras_mirror.MirroredModel(_model(), devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mirrored.fit(x, y, **kwargs)

    stock_error = max_diff(reference.get_weights(), stock.get_weights())
    ours = max_diff(reference.get_weights(), mirrored.model.get_weights())
    print(f"stock error {stock_error:.4g}, keras-mirror error {ours:.3g}")
    assert stock_error > 1e-2
    assert ours < 1e-5
