"""keras-mirror: exact data-parallel training of an existing Keras model.

The public names are imported on first use (PEP 562), so that importing a
module that needs no TensorFlow, such as `keras_mirror.launch` (the
`keras-mirror launch` command), does not pay TensorFlow's start-up.

In a multi-worker run (`TF_CONFIG`, or an `srun` step of 2+ tasks),
importing keras-mirror sets this worker up (`keras_mirror.init()`) before
TensorFlow initialises its devices, so that a plain script needs no other
line; `KERAS_MIRROR_INIT=0` turns that off.
"""

import importlib
import sys

# `replica_context` is both a submodule and a function: bind the function
# now, or importing the submodule would leave the module under this name.
from keras_mirror.replica_context import ReplicaContext as ReplicaContext
from keras_mirror.replica_context import replica_context as replica_context
from keras_mirror.version import __version__ as __version__

_EXPORTS = {
    "MirroredModel": "keras_mirror.mirrored_model",
    "ReplicaTensorBoard": "keras_mirror.callbacks.replica_tensorboard",
    "StepBackup": "keras_mirror.callbacks.step_backup",
    "VerifyReport": "keras_mirror.verify",
    "init": "keras_mirror.distribute._multi_worker",
    "load_model": "keras_mirror.saving",
    "logical_cpus": "keras_mirror.distribute.devices",
}

_SUBMODULES = ("allreduce", "callbacks", "cli", "demo", "errors", "launch",
               "mirrored_model", "saving", "split", "verify",
               "version")

# Public modules that live in a subpackage, under their old names.
_MOVED = {
    "cluster": "keras_mirror.distribute.cluster",
    "devices": "keras_mirror.distribute.devices",
}

__all__ = sorted([*_EXPORTS, "ReplicaContext", "__version__", "errors",
                  "replica_context"])


_NO_TENSORFLOW = (
    "keras-mirror needs TensorFlow, which is not installed. Install one "
    "flavour: `pip install \"keras-mirror[tensorflow]\"` (or "
    "`[tensorflow-cpu]`; `[and-cuda]` for NVIDIA GPUs). Received: "
    "import tensorflow failed ({error})")


def _import(module):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != "tensorflow" and not str(e.name).startswith(
                "tensorflow."):
            raise
        raise ModuleNotFoundError(_NO_TENSORFLOW.format(error=e),
                                  name=e.name) from e


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(_import(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:  # `keras_mirror.split.balanced_sizes(...)`
        return _import(f"keras_mirror.{name}")
    if name in _MOVED:  # `keras_mirror.cluster.parse_cluster(...)`
        module = _import(_MOVED[name])
        # `import keras_mirror.cluster` then finds the same module.
        sys.modules.setdefault(f"keras_mirror.{name}", module)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'keras_mirror' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


importlib.import_module("keras_mirror.distribute._multi_worker").auto_init()
