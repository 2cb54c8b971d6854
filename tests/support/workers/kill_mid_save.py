"""A worker that SIGKILLs itself in the middle of a save (tests/
test_saving.py).

Usage: `python kill_mid_save.py MODE DIR`. Trains a small `MirroredModel`
on 2 logical CPUs and saves once normally, writing the saved weights to
`DIR/first.npz`; then it makes the file writer kill the process just before
it closes the file (the archive or HDF5 file half written) and saves again:

- `save`: `mirrored.save(DIR/model.keras)`, killed in `ZipFile.close`.
- `checkpoint`: `fit` with `keras.callbacks.ModelCheckpoint(
  DIR/ckpt.weights.h5, save_weights_only=True)` given the `MirroredModel`,
  killed in `h5py.File.close` while saving after epoch 2 (the callback
  gets the user's model, whose saves go through the wrapper's).
"""

import os
import signal
import sys

if __name__ == "__main__":  # not when a test imports this module
    import _lean  # noqa: F401  (beside this script: before Keras)
import keras_mirror

keras_mirror.logical_cpus(2)

import zipfile  # noqa: E402

import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402


def _kill_on_close(cls):
    def close(self, *args, **kwargs):
        print("killing myself mid-save", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    cls.close = close


class _KillOnSecondSave(keras.callbacks.Callback):
    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:  # the checkpoint of epoch 0 is complete
            np.savez(os.path.join(self.directory, "first.npz"),
                     *self.model.get_weights())
            _kill_on_close(h5py.File)


def main(mode, directory):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.ones((16, 3), "float32")
    if mode == "save":
        mirrored.fit(x, y, batch_size=8, verbose=0)
        mirrored.save(os.path.join(directory, "model.keras"))
        np.savez(os.path.join(directory, "first.npz"),
                 *mirrored.model.get_weights())
        mirrored.fit(x, y, batch_size=8, verbose=0)
        _kill_on_close(zipfile.ZipFile)
        mirrored.save(os.path.join(directory, "model.keras"))
    else:
        checkpoint = keras.callbacks.ModelCheckpoint(
            os.path.join(directory, "ckpt.weights.h5"),
            save_weights_only=True)
        mirrored.fit(x, y, batch_size=8, epochs=3, verbose=0,
                     callbacks=[checkpoint, _KillOnSecondSave(directory)])
    print("not killed", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
