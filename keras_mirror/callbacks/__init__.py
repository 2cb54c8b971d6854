"""Callbacks for `MirroredModel.fit`."""

from keras_mirror.callbacks.replica_tensorboard import (
    ReplicaTensorBoard as ReplicaTensorBoard,
)
