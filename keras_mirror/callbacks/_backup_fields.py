"""Reading a step backup safely: regular files only, fields of the kinds
the variables hold."""

import os
import stat

import numpy as np

from keras_mirror import errors


def open_regular(path):
    """`path` opened for reading if it is a regular file; never blocks.

    O_NONBLOCK keeps `open` of a FIFO from waiting for a writer; O_NOFOLLOW
    is not used, so a symlink to a regular file still works.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise errors.StepBackupError(
                f"The step backup {path!r} is not a regular file (a FIFO, "
                "device, socket or directory); it cannot be read. Remove "
                "it, or pass another `backup_dir`. "
                f"Received: mode={stat.filemode(mode)}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def same_kind(stored, expected):
    """Whether a stored array can be assigned to a variable of `expected`
    dtype without changing its meaning: never complex, strings or objects;
    integers and bools only where the variable holds them."""
    kind = np.dtype(stored).kind
    if kind not in "biuf":
        return kind == "V" and "float" in str(expected)  # bfloat16
    if "int" in str(expected):
        return kind in "iu"
    if str(expected) == "bool":
        return kind == "b"
    return kind != "b"


def show(value):
    text = repr(np.asarray(value).tolist())
    return text if len(text) <= 80 else text[:77] + "..."
