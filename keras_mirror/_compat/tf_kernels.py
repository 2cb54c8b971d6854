"""Which TensorFlow CPU kernels run: oneDNN's or TensorFlow's own."""

import os
import platform

# -- oneDNN (keras_mirror.steps._stand_in) -----------------------------------

# TF 2.21's oneDNN CPU convolution backprop fails on some small batches
# (docs/onednn.md), so keras-mirror pads a replica's odd shard where
# oneDNN runs. TensorFlow says whether it does only in private:
# `_pywrap_util_port.IsMklEnabled()` is TensorFlow's own runtime answer
# (`TF_ENABLE_ONEDNN_OPTS` read once, and the build and the platform). Where
# the module or the function is gone, the documented rule decides: oneDNN
# is on by default in x86-64 Linux builds (TensorFlow 2.9 and later) unless
# `TF_ENABLE_ONEDNN_OPTS` is "0", "false" or "off", and off elsewhere unless
# it is "1", "true" or "on".
_TF_PORT_MODULE = "tensorflow.python.util._pywrap_util_port"
_TF_ONEDNN_PROBE = "IsMklEnabled"


def onednn_enabled():
    """Whether TensorFlow runs oneDNN's CPU kernels in this process."""
    import importlib

    try:
        module = importlib.import_module(_TF_PORT_MODULE)
    except ImportError:
        module = None
    probe = getattr(module, _TF_ONEDNN_PROBE, None)
    if probe is not None:
        return bool(probe())
    return onednn_by_rule(os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
                          platform.system(), platform.machine())


def onednn_by_rule(env, system, machine):
    """TensorFlow's documented default, from `TF_ENABLE_ONEDNN_OPTS`."""
    value = (env or "").strip().lower()
    if value in ("0", "false", "off"):
        return False
    if value in ("1", "true", "on"):
        return True
    return system == "Linux" and machine.lower() in ("x86_64", "amd64")
