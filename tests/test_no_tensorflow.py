"""Without TensorFlow, the first use of keras-mirror says what to install."""

import subprocess
import sys
import textwrap

from test_launch import _clean_session  # noqa: F401


def test_missing_tensorflow_names_the_extra_to_install():
    # A meta-path finder that hides TensorFlow, in a fresh interpreter.
    code = textwrap.dedent("""
        import sys

        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "tensorflow" or name.startswith("tensorflow."):
                    raise ModuleNotFoundError(
                        f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Hide())
        import os
        os.environ["KERAS_MIRROR_INIT"] = "0"
        import keras_mirror
        try:
            keras_mirror.MirroredModel
        except ModuleNotFoundError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120)
    assert "keras-mirror needs TensorFlow, which is not installed" in \
        out.stdout, out.stdout + out.stderr
    assert 'pip install "keras-mirror[tensorflow]"' in out.stdout
