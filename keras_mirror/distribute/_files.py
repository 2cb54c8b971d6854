"""Writing model files safely, and loading weights all or nothing.

`write_atomically` writes through a temporary file renamed into place;
`load_weights` checks every shape before assigning any. `saving` re-exports
both.
"""

import contextlib
import os
import shutil
import tempfile

import h5py

from keras_mirror import errors
from keras_mirror.distribute import _homes


def check_suffix(filepath, suffix, why=""):
    """`filepath` as a str; refused unless it ends in `suffix`."""
    filepath = str(filepath)
    if not filepath.endswith(suffix):
        raise ValueError(
            f"`filepath` must end in `{suffix}`{why}. "
            f"Received: filepath={filepath!r}")
    return filepath


def write_atomically(save, filepath, overwrite=True, **kwargs):
    """Runs `save(temporary, overwrite=True, **kwargs)`, then renames.

    The temporary file sits in `filepath`'s directory (same file system),
    is synced to disk and replaces `filepath` with `os.replace`, so that a
    process killed at any moment leaves the previous file or the new one,
    never a partial file or none. Keras's own scratch folders (a `.keras`
    save's `tmpXXXX/assets`) go in a hidden folder next to it. Temporaries
    of earlier killed saves of the same file are removed first. A failed
    write (a full disk) raises an `OSError` naming `filepath`, which keeps
    its previous content. With `overwrite=False` and an existing file,
    Keras's own prompt decides (and writes in place).
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
        elif name.startswith(prefix) and name.endswith(_SCRATCH):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    temporary = os.path.join(directory,
                             f"{prefix}{os.getpid()}.tmp{extension}")
    try:
        with _scratch_in(os.path.join(
                directory, f"{prefix}{os.getpid()}{_SCRATCH}")):
            save(temporary, overwrite=True, **kwargs)
        fsync(temporary)
        os.replace(temporary, path)
    except OSError as e:
        _remove_quietly(temporary)
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(e.errno, (
            f"Could not write `filepath` ({reason}); the file "
            "keeps its previous content, if any. Free space or save "
            f"elsewhere. Received: filepath={os.fspath(filepath)!r}"
        )) from e
    except BaseException:
        _remove_quietly(temporary)
        raise
    fsync(directory)


_SCRATCH = ".scratch"


@contextlib.contextmanager
def _scratch_in(folder):
    """Points `tempfile` at `folder` while Keras saves (Keras makes its
    scratch folders with `tempfile.mkdtemp`); removes it afterwards."""
    os.mkdir(folder)
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


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


def load_weights(model, filepath, skip_mismatch=False, **kwargs):
    """`model.load_weights(filepath)`, all or nothing.

    The file is opened and, unless `skip_mismatch`, every variable's shape
    is compared with the model's before anything is assigned (Keras
    assigns layer by layer and fails at the first layer that does not
    fit, after the earlier ones were overwritten). Should Keras still fail
    part way, every variable of the model and its optimizers gets its
    value from before the call back.
    """
    check_weights_file(filepath)
    if not skip_mismatch:
        _check_shapes(model, filepath)
    variables = list(model.variables) + [
        v for optimizer in _homes.optimizers_of(model)
        for v in optimizer.variables]
    before = [v.numpy() for v in variables]
    try:
        model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
    except BaseException:
        for v, value in zip(variables, before):
            v.assign(value)
        raise


def _datasets(path):
    """{group: {name: shape}} of every dataset in an HDF5 file."""
    groups = {}

    def visit(name, item):
        if isinstance(item, h5py.Dataset):
            group, _, leaf = name.rpartition("/")
            groups.setdefault(group, {})[leaf] = tuple(item.shape)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return groups


def _check_shapes(model, filepath):
    with tempfile.TemporaryDirectory() as folder:
        own = os.path.join(folder, "model.weights.h5")
        model.save_weights(own)
        expected = _datasets(own)
    given = _datasets(filepath)
    for group in sorted(set(expected) & set(given)):
        mine, theirs = expected[group], given[group]
        if mine.keys() != theirs.keys() and \
                not group.startswith("optimizer"):
            detail = (f"{group!r} holds {len(theirs)} variable(s) in the "
                      f"file and {len(mine)} in the model")
        else:
            bad = [k for k in sorted(mine) if k in theirs
                   and mine[k] != theirs[k]]
            if not bad:
                continue
            detail = (f"'{group}/{bad[0]}' has shape {theirs[bad[0]]} in "
                      f"the file and {mine[bad[0]]} in the model")
        raise ValueError(
            "`filepath` holds weights that do not fit this model: "
            f"{detail}. Nothing was loaded. Load weights saved from the "
            "same architecture, or pass `skip_mismatch=True`. "
            f"Received: filepath={filepath!r}")


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


def fsync(path):
    """`fsync` of a file or directory; failures are ignored (some file
    systems cannot sync a directory)."""
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
