"""`keras_mirror/_compat/tf_kernels.py`: one test per private attribute.

Each fails loudly when TensorFlow renames or removes what it checks.
"""

import importlib
import os
import subprocess
import sys

import pytest

from keras_mirror import _compat


def test_onednn_probe_exists_and_answers():
    module = importlib.import_module(_compat._TF_PORT_MODULE)
    probe = getattr(module, _compat._TF_ONEDNN_PROBE)
    assert _compat.onednn_enabled() is bool(probe())
    # This process left TF_ENABLE_ONEDNN_OPTS to TensorFlow's default.
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") is None:
        assert _compat.onednn_enabled() is _compat.onednn_by_rule(
            None, *_platform())


def _platform():
    import platform

    return platform.system(), platform.machine()


def test_onednn_probe_follows_the_environment_variable():
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0",
               TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, "-c", "from keras_mirror import _compat; "
         "print(_compat.onednn_enabled())"], env=env, capture_output=True,
        text=True, timeout=60, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("env,system,machine,enabled", [
    (None, "Linux", "x86_64", True),
    ("0", "Linux", "x86_64", False),
    ("false", "Linux", "x86_64", False),
    ("1", "Darwin", "arm64", True),
    (None, "Darwin", "arm64", False),
    (None, "Linux", "aarch64", False),
])
def test_onednn_by_rule(env, system, machine, enabled):
    assert _compat.onednn_by_rule(env, system, machine) is enabled
