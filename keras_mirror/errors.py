"""Exceptions raised by keras-mirror.

Each class also subclasses the matching builtin, so that users can catch
either the keras-mirror class or the builtin (`except ValueError`), as in
KerasTuner's `FatalValueError(FatalError, ValueError)`.
"""


class KerasMirrorError(Exception):
    """Base class of every keras-mirror error."""


class DeviceError(KerasMirrorError, ValueError):
    """A device list that names no device, an unknown one or a duplicate."""


class DevicesAlreadyInitializedError(KerasMirrorError, RuntimeError):
    """TensorFlow's devices were initialised before `logical_cpus` ran."""


class ModelRebuildError(KerasMirrorError, ValueError):
    """The wrapped model's variables could not be rebuilt under the strategy."""


class NonFiniteError(KerasMirrorError, FloatingPointError):
    """A replica produced a NaN or Inf loss or gradient."""


class ClusterConfigError(KerasMirrorError, ValueError):
    """`TF_CONFIG` or the `cluster` argument is malformed."""


class UnsafeModelError(KerasMirrorError, ValueError):
    """A model file that could run code when loaded, or is not `.keras`."""


class LossReductionError(KerasMirrorError, ValueError):
    """A loss term that is neither a batch mean nor a batch sum."""


class StepBackupError(KerasMirrorError, ValueError):
    """A step backup that is unreadable or does not fit the model."""


class BackupDirectoryError(KerasMirrorError, OSError):
    """A `StepBackup` directory that cannot be created or written."""


class ModelFileError(KerasMirrorError, ValueError):
    """A model file that is empty, truncated or corrupt."""


class StrategyScopeError(KerasMirrorError, ValueError):
    """A `MirroredModel` used inside another `tf.distribute` strategy's
    scope, or wrapping a model built under another strategy."""
