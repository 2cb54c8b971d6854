"""keras-mirror: exact data-parallel training of an existing Keras model."""

from keras_mirror import errors
from keras_mirror.callbacks.replica_tensorboard import ReplicaTensorBoard
from keras_mirror.callbacks.step_backup import StepBackup
from keras_mirror.devices import logical_cpus
from keras_mirror.mirrored_model import MirroredModel
from keras_mirror.replica_context import ReplicaContext
from keras_mirror.replica_context import replica_context
from keras_mirror.saving import load_model
from keras_mirror.version import __version__

__all__ = [
    "MirroredModel",
    "ReplicaContext",
    "ReplicaTensorBoard",
    "StepBackup",
    "__version__",
    "errors",
    "load_model",
    "logical_cpus",
    "replica_context",
]
