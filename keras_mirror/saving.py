"""Loading saved models safely: `.keras` files only, always in safe mode.

A full-model file is code as much as data: a legacy `.h5` model or a
`.keras` archive whose `config.json` names a Python function can run that
function when it loads. `load_model` loads only `.keras` zip archives from
the local disk, refuses any object whose config points outside Keras (unless
it is a registered custom object), and calls Keras's loader with
`safe_mode=True`, which refuses `Lambda` bytecode. It never turns safe mode
off process-wide (`keras.config.enable_unsafe_deserialization`).
"""

import builtins
import json
import os
import posixpath
import zipfile
import zlib

import keras

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror.distribute._files import (
    check_weights_file as check_weights_file,
)
from keras_mirror.distribute._files import fsync as fsync
from keras_mirror.distribute._files import load_weights as load_weights
from keras_mirror.distribute._files import write_atomically as write_atomically

# Packages whose objects Keras itself resolves by module in safe mode.
_TRUSTED_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp")
_CONFIG = "config.json"
_MAX_DEPTH = 100
# What may be read of one archive member, by its declared size and by the
# bytes it really decompresses to (a zip can lie about sizes). Keras's own
# configs and metadata are kilobytes (a large keras_hub model's config is
# under 1 MiB); weights and assets are as large as the model.
MAX_JSON_BYTES = 64 * 2**20
MAX_MEMBER_BYTES = 64 * 2**30
# What the JSON members may hold: parsing makes a Python object of every
# value and key (about 70 bytes each, and Keras parses `config.json` again),
# so 64 MiB of `[{},{},...]` grew a process by 2.9 GB. A bound by counting
# `,` `:` `[` `{` (strings included: it only overcounts); a large
# keras_hub model's config holds about 50,000.
MAX_JSON_VALUES = 2**20
_JSON_MEMBERS = (_CONFIG, "metadata.json")
_CHUNK = 2**20


def _check_path(filepath):
    path = filepath
    if isinstance(filepath, os.PathLike):
        path = os.fspath(filepath)
    if not isinstance(path, str) or not path.endswith(".keras"):
        raise errors.UnsafeModelError(
            "`filepath` must be a `.keras` file: legacy `.h5` full models "
            "and SavedModel directories can carry code, and keras-mirror "
            "loads neither (use `load_weights` for `.weights.h5`). "
            f"Received: filepath={filepath!r}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            "`filepath` must name an existing local `.keras` file. "
            f"Received: filepath={filepath!r}"
        )
    if not zipfile.is_zipfile(path):
        _check_not_truncated(filepath, path)
        raise errors.UnsafeModelError(
            "`filepath` must be a `.keras` zip archive. "
            f"Received: filepath={filepath!r}, which is not a zip file"
        )
    return path


def _check_not_truncated(filepath, path):
    """An empty file, or a zip archive cut short: `ModelFileError`."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head in (b"", b"PK\x03\x04"):
        what = "empty" if not head else "a truncated zip archive"
        raise errors.ModelFileError(
            f"`filepath` must be a complete `.keras` archive, but the file "
            f"is {what} (a save that did not finish?). Save the model "
            "again or load an earlier copy. "
            f"Received: filepath={filepath!r}"
        )


def _read_config(path):
    try:
        with zipfile.ZipFile(path) as archive:
            _check_members(archive.namelist(), path)
            if _CONFIG not in archive.namelist():
                raise errors.UnsafeModelError(
                    f"`filepath` must be a `.keras` archive with a "
                    f"`{_CONFIG}`. Received: filepath={path!r}"
                )
            for info in archive.infolist():
                data = _read_member(archive, info, path)
                if info.filename == _CONFIG:
                    text = data
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise errors.ModelFileError(
            f"`filepath` must be an intact `.keras` archive, but it is "
            f"corrupt ({e}). Save the model again or load an earlier copy. "
            f"Received: filepath={path!r}"
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise errors.UnsafeModelError(
            f"`filepath` holds a `{_CONFIG}` nested too deeply to be a "
            f"Keras model config. Received: filepath={path!r}"
        ) from None
    except ValueError as e:
        raise errors.UnsafeModelError(
            f"`filepath` holds a `{_CONFIG}` that is not valid JSON "
            f"({e}). Received: filepath={path!r}"
        ) from None


def _limit(name):
    return MAX_JSON_BYTES if name in _JSON_MEMBERS else MAX_MEMBER_BYTES


def _read_member(archive, info, path):
    """Reads a member through, checking its CRC-32, within its limit: by
    its declared size first, then by the bytes it decompresses to. Returns
    the bytes of a JSON member (None for the others, read in chunks)."""
    limit = _limit(info.filename)
    if info.file_size > limit:
        raise _too_large(path, info.filename, f"declares {info.file_size}",
                         limit)
    keep = info.filename in _JSON_MEMBERS
    chunks, read = [], 0
    with archive.open(info) as member:
        while True:
            chunk = member.read(min(_CHUNK, limit + 1 - read))
            if not chunk:
                break
            read += len(chunk)
            if read > limit:
                raise _too_large(path, info.filename,
                                 f"decompresses to more than {limit}", limit)
            if keep:
                chunks.append(chunk)
    if not keep:
        return None
    data = b"".join(chunks)
    values = 1 + sum(data.count(c) for c in (b",", b":", b"[", b"{"))
    if values > MAX_JSON_VALUES:
        raise errors.UnsafeModelError(
            f"`filepath` holds the archive member {info.filename!r}, which "
            f"holds up to {values} JSON values; keras-mirror parses at most "
            f"{MAX_JSON_VALUES} (`keras_mirror.saving.MAX_JSON_VALUES`): "
            "each takes memory once parsed, so it refuses the file before "
            "Keras reads it. Raise that limit only for a file you trust. "
            f"Received: filepath={path!r}")
    return data


def _too_large(path, name, what, limit):
    knob = "MAX_JSON_BYTES" if name in _JSON_MEMBERS else "MAX_MEMBER_BYTES"
    return errors.UnsafeModelError(
        f"`filepath` holds the archive member {name!r}, which {what} "
        f"bytes; keras-mirror reads at most {limit} bytes of it "
        f"(`keras_mirror.saving.{knob}`), so it refuses the file before "
        "Keras reads it. Raise that limit only for a file you trust. "
        f"Received: filepath={path!r}"
    )


def _leaves_archive(name):
    """Whether an archive member's name points outside the archive."""
    name = name.replace("\\", "/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return True
    normal = posixpath.normpath(name)
    return normal == ".." or normal.startswith("../")


def _check_members(names, path):
    """Refuses archive members named outside the archive (path traversal),
    before Keras extracts anything."""
    for name in names:
        if _leaves_archive(name):
            raise errors.UnsafeModelError(
                f"`filepath` holds the archive member {name!r}, whose name "
                "leaves the archive (an absolute path or `..`): extracting "
                "it could write anywhere, so keras-mirror refuses the "
                f"file. Received: filepath={path!r}")


def _depth(config):
    """How deeply dicts and lists nest in `config` (iteratively)."""
    deepest, stack = 0, [(config, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            values = node.values() if isinstance(node, dict) else node
            stack.extend((v, depth + 1) for v in values)
    return deepest


def _is_registered(entry, custom_objects):
    names = {entry.get("registered_name"), entry.get("class_name")}
    known = set(custom_objects or {}) | set(keras.saving.get_custom_objects())
    return bool(names & known)


def _objects(config):
    """Every dict in the config tree (depth first)."""
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _unsafe_entry(entry, custom_objects):
    """Why `entry` could run code on load, or None."""
    if entry.get("class_name") == "__lambda__" or \
            entry.get("function_type") == "lambda":
        return "a Python lambda (bytecode)"
    module = entry.get("module")
    if not isinstance(module, str) or "class_name" not in entry:
        return None
    if module == "builtins":
        return _unsafe_builtin(entry)
    if module.split(".")[0] in _TRUSTED_PACKAGES:
        return None
    if _is_registered(entry, custom_objects):
        return None
    return (f"the object {entry.get('class_name')!r} of module {module!r}, "
            "which is neither part of Keras nor a registered custom object")


def _unsafe_builtin(entry):
    """Keras writes `module: builtins` only for its own functions by name
    (`class_name: function`, `config: 'relu'`); a Python builtin is code."""
    name = entry.get("config")
    if entry.get("class_name") != "function" or not isinstance(name, str) \
            or hasattr(builtins, name):
        shown = name if entry.get("class_name") == "function" else \
            entry.get("class_name")
        return (f"the Python builtin {shown!r} (module 'builtins'), "
                "which is not a Keras function")
    return None


def check_config(config, filepath, custom_objects=None):
    """Raises `UnsafeModelError` if `config` names code outside Keras."""
    if _depth(config) > _MAX_DEPTH:
        raise errors.UnsafeModelError(
            f"`filepath` holds a `{_CONFIG}` nested deeper than "
            f"{_MAX_DEPTH} levels, too deep for a Keras model config. "
            f"Received: filepath={filepath!r}"
        )
    for entry in _objects(config):
        reason = _unsafe_entry(entry, custom_objects)
        if reason:
            raise errors.UnsafeModelError(
                f"`filepath` holds a model whose config names {reason}; "
                "loading it could run arbitrary code, so keras-mirror "
                "refuses it. Register trusted custom objects with "
                "`keras.saving.register_keras_serializable` or pass them "
                f"in `custom_objects`. Received: filepath={filepath!r}"
            )


def load_model(filepath, devices=None, custom_objects=None, compile=True,
               **mirrored_kwargs):
    """Loads a `.keras` model in safe mode, optionally as a `MirroredModel`.

    Only local `.keras` zip archives load. Their `config.json` is checked
    first: an object from outside Keras that is not a registered custom
    object (e.g. `{"module": "os", "class_name": "system"}`) or a `Lambda`
    with Python bytecode is refused before Keras sees the file. Keras then
    loads it with `safe_mode=True`. The process-wide safe-mode setting is
    left as it was.

    Every member of the archive is read through first (its CRC-32 checked)
    and held to a limit, by its declared size and by the bytes it really
    decompresses to: `MAX_JSON_BYTES` (64 MiB) for `config.json` and
    `metadata.json`, `MAX_MEMBER_BYTES` (64 GiB) for the weights and each
    asset; the JSON members hold at most `MAX_JSON_VALUES` (1,048,576)
    values. All are attributes of `keras_mirror.saving`, to raise for a
    file you trust.

    Args:
        filepath: str or path-like. A `.keras` file.
        devices: list of str, or None. When given, the loaded model is
            wrapped in a `MirroredModel` over these devices; default None
            (return the plain Keras model).
        custom_objects: dict or None. Trusted custom classes and functions
            by name, as in `keras.saving.load_model`.
        compile: bool. Restore the compile configuration; default True.
        **mirrored_kwargs: further `MirroredModel` arguments (`batch`,
            `on_nonfinite`, ...), used only with `devices`.

    Returns:
        A `keras.Model`, or a `MirroredModel` when `devices` is given.

    Raises:
        UnsafeModelError: the file is not a `.keras` zip archive, its
            config names code outside Keras, or a member is over its limit.
        ModelFileError: the file is empty, truncated or corrupt.
        FileNotFoundError: no such local file.

    Example:

    ```python
    import keras_mirror

    model = keras_mirror.load_model("model.keras")
    mirrored = keras_mirror.load_model("model.keras", devices=["/cpu:0"])
    ```
    """
    _compat.check_keras_version()
    if devices is None and mirrored_kwargs:
        raise ValueError(
            "`MirroredModel` arguments need `devices`. "
            f"Received: devices=None, {sorted(mirrored_kwargs)}"
        )
    path = _check_path(filepath)
    check_config(_read_config(path), filepath, custom_objects)
    model = keras.saving.load_model(
        path, custom_objects=custom_objects, compile=compile, safe_mode=True
    )
    if devices is None:
        return model
    from keras_mirror.mirrored_model import MirroredModel

    return MirroredModel(model, devices=devices, **mirrored_kwargs)
