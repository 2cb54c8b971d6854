"""A plain training script, as a user writes it: build, wrap, fit.

No keras-mirror call besides `MirroredModel`: under `keras-mirror launch`
(or a hand-set `TF_CONFIG`, or `srun`), `import keras_mirror` sets the
worker up. Same model, data and batches as `mw_train.py` (45 rows, global
batch 8, 2 epochs). usage: plain_train.py OUT_DIR
"""

import os
import sys

import keras
import numpy as np

import keras_mirror

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((6,)),
    keras.layers.Dense(16, activation="tanh"),
    keras.layers.Dense(3),
])
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
rng = np.random.default_rng(1)
x = rng.normal(size=(45, 6)).astype("float32")
y = rng.normal(size=(45, 3)).astype("float32")

mirrored = keras_mirror.MirroredModel(model)
mirrored.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

np.savez(os.path.join(sys.argv[1], f"weights_{os.getpid()}.npz"),
         *mirrored.model.get_weights(),
         replicas=mirrored.num_replicas, workers=mirrored.num_workers)
