"""Safe reading of a step backup's file and fields."""

import os

import numpy as np
import pytest

from keras_mirror import errors
from keras_mirror.callbacks import _backup_fields


def test_open_regular_refuses_a_fifo_without_blocking(tmp_path):
    path = str(tmp_path / "fifo")
    os.mkfifo(path)  # a blocking open would wait here for a writer
    with pytest.raises(errors.StepBackupError,
                       match="is not a regular file.*Received: mode=p"):
        _backup_fields.open_regular(path)


def test_open_regular_reads_a_regular_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    with _backup_fields.open_regular(str(path)) as f:
        assert f.read() == b"abc"


@pytest.mark.parametrize("stored, expected, ok", [
    ("float32", "float32", True), ("float64", "float32", True),
    ("complex64", "float32", False), ("<U3", "float32", False),
    ("object", "float32", False), ("int64", "int64", True),
    ("float32", "int64", False), ("bool", "bool", True),
    ("bool", "float32", False),
])
def test_same_kind(stored, expected, ok):
    assert _backup_fields.same_kind(np.dtype(stored), expected) is ok
