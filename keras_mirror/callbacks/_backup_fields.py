"""Reading a step backup safely: regular files only, and every field's
shape and dtype checked against what this run expects before any data is
read.

A backup is an uncompressed `.npz` (a zip of `.npy` members) written by
`StepBackup.save`. `read` checks its members' headers (shape and dtype, as
NumPy stores them in front of the data) against `expected`, so that a
field of the wrong kind, a missing or unknown field, or a header declaring
more data than the file holds is refused before NumPy allocates anything.
"""

import collections
import os
import stat
import zipfile

import numpy as np
import tensorflow as tf

from keras_mirror import errors

Field = collections.namedtuple("Field", ["shape", "dtype", "what"])
Field.__doc__ = """What a backup field must be.

`shape` is a tuple whose `None` entries match any length; `dtype` is a
NumPy dtype, matched exactly, or `INTEGER` for any integer dtype; `what`
says what the field holds, for error messages."""

INTEGER = "integer"  # a `Field.dtype`: any integer dtype
_MAX_HEADER = 10000  # NumPy's own default limit on a `.npy` header


def open_regular(path):
    """`path` opened for reading if it is a regular file; never blocks.

    `os.stat` first (a FIFO, socket, device or directory is refused without
    being opened), then the opened file's `fstat` again, in case the path
    was swapped in between; O_NONBLOCK keeps even that `open` of a FIFO
    from waiting for a writer. A symlink to a regular file still works.
    """
    _check_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        _check_regular(path, os.fstat(fd).st_mode)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_regular(path, mode):
    if not stat.S_ISREG(mode):
        raise errors.StepBackupError(
            f"The step backup {path!r} is not a regular file (a FIFO, "
            "device, socket or directory); it cannot be read. Remove "
            "it, or pass another `backup_dir`. "
            f"Received: mode={stat.filemode(mode)}")


def fields_of(model_vars, opt_vars):
    """The fields `StepBackup.save` writes for these variables, by name:
    `w<i>` and `o<i>` for the model's and optimizers' variables, and the
    position (the virtual shards' fields are `_virtual_shards`')."""
    fields = {"position": Field((2,), INTEGER, "the position (epoch, step)")}
    for prefix, group in (("w", model_vars), ("o", opt_vars)):
        for i, v in enumerate(group):
            fields[f"{prefix}{i}"] = Field(
                tuple(v.shape), tf.as_dtype(v.dtype).as_numpy_dtype,
                f"variable {v.path!r}")
    return fields


def check_counts(keys, model_vars, opt_vars, mismatch):
    """Raises `mismatch(detail)` for a backup of another model: one whose
    numbers of variables differ."""
    counts = (sum(_is_key(k, "w") for k in keys),
              sum(_is_key(k, "o") for k in keys))
    if counts != (len(model_vars), len(opt_vars)):
        raise mismatch(
            f"it holds {counts[0]} model and {counts[1]} optimizer "
            f"variables, the model and optimizer have {len(model_vars)} "
            f"and {len(opt_vars)}")


def needs_mirrored_fit(model):
    """The error of a `StepBackup` in a fit other than `MirroredModel.fit`
    (which alone can restart the input where the backup was written)."""
    return ValueError(
        "`StepBackup` needs `MirroredModel.fit`: it resumes by restarting "
        "the input where the backup was written, which a plain "
        "`Model.fit` cannot do. Wrap the model "
        "(`keras_mirror.MirroredModel(model).fit(...)`) or use "
        "`keras.callbacks.BackupAndRestore`. "
        f"Received: model={type(model).__name__}")


def _is_key(key, prefix):
    return key.startswith(prefix) and key[len(prefix):].isdigit()


def create_new(path):
    """`path` opened for writing as a new regular file; never blocks.

    A stale entry of that name (a FIFO, a symlink) is removed first and the
    file is created with O_EXCL and O_NOFOLLOW: writing never follows a
    link or waits for a FIFO's reader.
    """
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | \
        getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o666), "wb")


def read(path, expected, mismatch, optional=None, first_check=None):
    """The backup's arrays by field, each of its `expected` dtype.

    Args:
        path: the backup file.
        expected: dict of field name to `Field`. Every field must be
            there.
        mismatch: function of a detail string returning the exception to
            raise for a field that does not fit.
        optional: dict of field name to `Field` (or its 3 values): fields
            checked when present, whose presence the caller checks.
        first_check: function of the fields' names, called first; it may
            raise. No field outside `expected` and `optional` is allowed.
    """
    expected = dict(expected)
    with open_regular(path) as raw:
        with zipfile.ZipFile(raw) as archive:
            headers = _headers(archive, mismatch)
        if first_check is not None:
            first_check(sorted(headers))
        for key, field in (optional or {}).items():
            if key in headers:
                expected[key] = Field(*field)
        _check_fields(headers, expected, mismatch)
        raw.seek(0)
        with np.load(raw, allow_pickle=False) as f:
            return {k: _as_expected(f[k], expected[k].dtype)
                    for k in headers}


def _headers(archive, mismatch):
    """{field: (shape, dtype)} from the members' `.npy` headers."""
    headers = {}
    for info in archive.infolist():
        name = info.filename
        key = name[:-len(".npy")] if name.endswith(".npy") else name
        if key in headers or not name.endswith(".npy"):
            raise mismatch(f"the member {name!r} is not a field StepBackup "
                           "writes (a duplicate, or not a `.npy` array)")
        if info.compress_type != zipfile.ZIP_STORED:
            raise mismatch(f"field {key!r} is compressed; StepBackup "
                           "writes its fields uncompressed")
        with archive.open(info) as member:
            shape, dtype, size = _header(member)
        if size + _nbytes(shape, dtype) > info.file_size:
            raise mismatch(
                f"field {key!r} declares shape {shape} and dtype {dtype} "
                f"({_nbytes(shape, dtype)} bytes), more than the "
                f"{info.file_size} bytes the file holds for it")
        headers[key] = shape, dtype
    return headers


def _header(member):
    """(shape, dtype, header bytes) of a `.npy` member, reading no data."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        read_header = np.lib.format.read_array_header_1_0
    elif version == (2, 0):
        read_header = np.lib.format.read_array_header_2_0
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    shape, _, dtype = read_header(member, max_header_size=_MAX_HEADER)
    return tuple(shape), dtype, member.tell()


def _nbytes(shape, dtype):
    return int(np.prod(shape, dtype=object)) * dtype.itemsize


def _check_fields(headers, expected, mismatch):
    for key in sorted(set(headers) - set(expected)):
        raise mismatch(f"field {key!r} is not one StepBackup writes for "
                       "this model and run")
    for key in sorted(set(expected) - set(headers)):
        raise mismatch(f"field {key!r} ({expected[key].what}) is missing")
    for key, field in expected.items():
        shape, dtype = headers[key]
        if not (_fits(shape, field.shape) and _same_dtype(dtype,
                                                          field.dtype)):
            want = "an integer dtype" if _any_integer(field.dtype) else \
                f"dtype {np.dtype(field.dtype).name}"
            raise mismatch(
                f"field {key!r} ({field.what}) must have shape "
                f"{_show_shape(field.shape)} and {want}. Received: {key} "
                f"of shape {shape} and dtype {_show_dtype(dtype)}")


def _fits(shape, expected):
    return len(shape) == len(expected) and all(
        e is None or s == e for s, e in zip(shape, expected))


def _same_dtype(stored, expected):
    """Whether an array of `stored` dtype holds values of `expected`: the
    same dtype in any byte order, or (NumPy writes ML dtypes such as
    bfloat16 as raw bytes) raw bytes of the same size for an ML dtype."""
    if stored.hasobject or stored.names is not None or \
            stored.subdtype is not None:
        return False
    if _any_integer(expected):
        return stored.kind in "iu"
    expected = np.dtype(expected)
    if stored.kind == "V":
        return expected.kind == "V" and stored.itemsize == expected.itemsize
    return stored.newbyteorder("=") == expected.newbyteorder("=")


def _any_integer(dtype):
    return isinstance(dtype, str) and dtype == INTEGER


def _as_expected(value, dtype):
    if _any_integer(dtype):
        return value
    dtype = np.dtype(dtype)
    if value.dtype.kind == "V":
        return value.view(dtype)
    return value.astype(dtype, copy=False)


def _show_shape(shape):
    return "(" + ", ".join("n" if d is None else str(d) for d in shape) + (
        ",)" if len(shape) == 1 else ")")


def _show_dtype(dtype):
    return dtype.name if dtype.kind in "biufc" else str(dtype)
