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
    ("float32", "float32", True), (">f4", "float32", True),
    ("float64", "float32", False), ("float16", "float32", False),
    ("complex64", "float32", False), ("<U3", "float32", False),
    ("int64", "int64", True), ("int32", "int64", False),
    ("float32", "int64", False), ("bool", "bool", True),
    ("bool", "float32", False), ("V4", "float32", False),
    ("int32", _backup_fields.INTEGER, True),
    ("uint8", _backup_fields.INTEGER, True),
    ("float32", _backup_fields.INTEGER, False),
])
def test_read_takes_only_the_expected_dtype(tmp_path, stored, expected, ok):
    path = str(tmp_path / "b.npz")
    np.savez(path, f=np.zeros(2, stored))
    fields = {"f": _backup_fields.Field((2,), expected, "a field")}
    if ok:
        value = _backup_fields.read(path, fields, ValueError)["f"]
        assert value.tolist() == [0, 0]
        assert value.dtype == (np.dtype(stored) if isinstance(
            expected, str) and expected == "integer" else np.dtype(expected))
    else:
        with pytest.raises(ValueError, match=(
                r"field 'f' \(a field\) must have shape \(2,\) and .*"
                r"Received: f of shape \(2,\) and dtype ")):
            _backup_fields.read(path, fields, ValueError)


def test_read_refuses_missing_and_unknown_fields(tmp_path):
    path = str(tmp_path / "b.npz")
    np.savez(path, f=np.zeros(2), g=np.zeros(1))
    fields = {"f": _backup_fields.Field((None,), "float64", "a field"),
              "h": _backup_fields.Field((), "float64", "the h")}
    with pytest.raises(ValueError, match="^field 'g' is not one StepBackup "
                       "writes for this model and run$"):
        _backup_fields.read(path, fields, ValueError)
    with pytest.raises(ValueError, match=r"^field 'h' \(the h\) is missing$"):
        _backup_fields.read(path, fields, ValueError,
                            optional={"g": ((1,), "float64", "the g")})


def test_create_new_replaces_a_fifo_without_blocking(tmp_path):
    path = tmp_path / "probe"
    os.mkfifo(path)  # opening it for writing would wait for a reader
    with _backup_fields.create_new(str(path)) as f:
        f.write(b"x")
    assert path.is_file() and path.read_bytes() == b"x"
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    path.unlink()
    path.symlink_to(target)
    with _backup_fields.create_new(str(path)) as f:
        f.write(b"new")
    assert target.read_bytes() == b"kept" and not path.is_symlink()
