"""Stock Keras `fit` under MirroredStrategy, run in its own process.

`python stock_fit.py OUT.npz` fits `model()` on `data()` with 4 logical CPU
replicas the stock way (model built in `strategy.scope()`), saves the
weights to OUT.npz and prints `{"error": null}`; or, when TF aborts the
collective all-reduce, prints `{"error": "<message>"}`. A collective abort
poisons the process ("Restart your program to reset"), hence the process.
"""

import json
import sys

import keras
import numpy as np

BATCH = 64


def model():
    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((10,)),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(1)])


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1025, 10)).astype("float32")
    y = rng.normal(size=(1025, 1)).astype("float32")
    return x, y


def main(out):
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 4)
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    x, y = data()
    with tf.distribute.MirroredStrategy(cpus).scope():
        stock = model()
        stock.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    try:
        stock.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    except tf.errors.OpError as error:
        lines = str(error).splitlines()
        found = [line for line in lines if "collective" in line.lower()]
        print(json.dumps({"error": " / ".join(lines[:1] + found)}))
        return
    np.savez(out, *stock.get_weights())
    print(json.dumps({"error": None}))


if __name__ == "__main__":
    main(sys.argv[1])
