"""Writing model and weight files atomically, and checking weight files.

Below `mirrored_model` (its `save` and `save_weights` write through
`write_atomically`) and below `saving` (whose `load_model` wraps in a
`MirroredModel`), so that neither imports the other both ways.
"""

import os

import h5py

from keras_mirror import errors


def write_atomically(save, filepath, overwrite=True, **kwargs):
    """Runs `save(temporary, overwrite=True, **kwargs)`, then renames.

    The temporary file sits in `filepath`'s directory (same file system),
    is synced to disk and replaces `filepath` with `os.replace`, so that a
    process killed at any moment leaves the previous file or the new one,
    never a partial file or none. Temporaries of earlier killed saves of the
    same file are removed first. With `overwrite=False` and an existing
    file, Keras's own prompt decides (and writes in place).
    """
    path = _check_save_path(filepath)
    if not overwrite and os.path.exists(path):
        return save(path, overwrite=False, **kwargs)
    directory, base = os.path.split(os.path.abspath(path))
    extension = ".weights.h5" if base.endswith(".weights.h5") else \
        os.path.splitext(base)[1]
    prefix = f".{base}."
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(".tmp" + extension):
            _remove_quietly(os.path.join(directory, name))
    temporary = os.path.join(directory,
                             f"{prefix}{os.getpid()}.tmp{extension}")
    try:
        save(temporary, overwrite=True, **kwargs)
        _fsync(temporary)
        os.replace(temporary, path)
    except BaseException:
        _remove_quietly(temporary)
        raise
    _fsync(directory)


def check_weights_file(filepath):
    """A `.weights.h5` file must exist and open as HDF5 (not truncated)."""
    if not os.path.isfile(filepath):
        raise FileNotFoundError(
            "`filepath` must name an existing `.weights.h5` file. "
            f"Received: filepath={filepath!r}")
    try:
        h5py.File(filepath, "r").close()
    except OSError as e:
        raise errors.ModelFileError(
            "`filepath` must be a complete `.weights.h5` file, but it "
            f"cannot be opened ({e}); it is empty, truncated or corrupt. "
            "Save the weights again or load an earlier copy. "
            f"Received: filepath={filepath!r}") from None


def _check_save_path(filepath):
    path = os.fspath(filepath)
    if os.path.isdir(path):
        raise IsADirectoryError(
            "`filepath` must name a file, not a directory. "
            f"Received: filepath={filepath!r}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"`filepath` must be in an existing directory; {directory!r} "
            "does not exist (create it first, e.g. with "
            f"`os.makedirs`). Received: filepath={filepath!r}")
    return path


def _fsync(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass
