"""Hiding TensorFlow's native start-up lines that a user cannot act on.

TensorFlow's C++ code writes to file descriptor 2 itself. Lines logged before
absl's logging starts ignore `TF_CPP_MIN_LOG_LEVEL`, so even at level 2 a CPU
machine shows the oneDNN notice, "Could not find cuda drivers" and a
`failed call to cuInit` *error* that says nothing is wrong. `native_stderr`
captures fd 2 while TensorFlow starts and replays every line except those.
"""

import contextlib
import os
import sys
import tempfile

# Substrings of the native lines hidden; everything else is replayed.
NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "TF-TRT Warning: Could not find TensorRT",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "rebuild TensorFlow with the appropriate compiler flags",
)


def is_noise(line):
    """Whether `line` is one of TensorFlow's start-up lines in `NOISE`."""
    return any(pattern in line for pattern in NOISE)


@contextlib.contextmanager
def native_stderr():
    """Captures fd 2 in the block, then replays all but the `NOISE` lines.

    Python's own writes to `sys.stderr` in the block (warnings, a
    traceback) are replayed too, in order, when the block ends. With
    `TF_CPP_MIN_LOG_LEVEL=0` (the user asked for everything) nothing is
    captured.
    """
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", "replace")
            for line in text.splitlines(keepends=True):
                if not is_noise(line):
                    sys.stderr.write(line)
            sys.stderr.flush()
