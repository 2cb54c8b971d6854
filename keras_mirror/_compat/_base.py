"""The version range and the checks every `_compat` module uses."""

import contextlib
import types

import keras

SUPPORTED_KERAS = ((3, 14), (3, 16))  # [low, high)


def keras_version():
    """The installed Keras version as a tuple of ints (major, minor)."""
    return tuple(int(p) for p in keras.__version__.split(".")[:2])


def check_keras_version():
    """Raises ImportError on a Keras release outside the supported range."""
    low, high = SUPPORTED_KERAS
    if not (low <= keras_version() < high):
        raise ImportError(
            "keras-mirror supports Keras >= "
            f"{low[0]}.{low[1]} and < {high[0]}.{high[1]}. "
            f"Received: keras.__version__={keras.__version__!r}"
        )


def check_backend():
    """Raises ValueError unless Keras runs on the TensorFlow backend.

    keras-mirror trains on `tf.distribute`; with another backend
    (`KERAS_BACKEND=jax`) `MirroredModel` would build, then fail later.
    """
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            "keras-mirror needs Keras's TensorFlow backend (it trains on "
            "`tf.distribute`). Set `KERAS_BACKEND=tensorflow` (or "
            '`"backend": "tensorflow"` in ~/.keras/keras.json) before '
            f"importing Keras. Received: keras.backend.backend()={backend!r}"
        )


def _missing(what, purpose):
    """The error for a private Keras name that a release no longer has."""
    return RuntimeError(
        f"This Keras release ({keras.__version__}) has no `{what}`; "
        f"keras-mirror cannot {purpose}. Install a supported Keras (see "
        "keras_mirror._compat).")


def _require(owner, names, label, purpose):
    """Raises `_missing` unless `owner` has every attribute in `names`."""
    for name in names:
        if not hasattr(owner, name):
            raise _missing(f"{label}.{name}", purpose)


def _replace_method(obj, name, make_hook, purpose, owner=None):
    """Sets `obj.<name>` to `make_hook(<the class's bound method>)`.

    For as long as `obj` lives (an own-step optimizer's hooks, set at
    compile); recorded as `owner.<name>` (see `recording`).
    """
    _require(obj, (name,), type(obj).__name__, purpose)
    original = getattr(type(obj), name).__get__(obj)
    setattr(obj, name, make_hook(original))
    _record(owner or type(obj).__name__, name)


# Every Keras or TF attribute keras-mirror replaces goes through `replaced`
# (or `_replace_method`, `note_replaced`), which names it `<owner>.<name>`:
# a module's import name, or for an object the Keras class that defines the
# attribute. `docs/architecture.md` lists them; `tests/compat/test_base.py`
# records what `fit` replaces for several models and checks that list
# against it.
_RECORDS = []


@contextlib.contextmanager
def recording():
    """Within the block, collects the label of every replacement made."""
    seen = set()
    _RECORDS.append(seen)
    try:
        yield seen
    finally:
        _RECORDS.remove(seen)


def _record(owner, name):
    for seen in _RECORDS:
        seen.add(f"{owner}.{name}")


def note_replaced(owner, name):
    """Records a replacement made without `replaced` (a variable's backing,
    swapped per variable)."""
    if _RECORDS:
        _record(owner, name)


@contextlib.contextmanager
def replaced(owner, replacements, label=None):
    """Within the block, `owner.<name>` is `replacements[name]`.

    `owner`: a module or a class (`setattr`), or an object (set with
    `object.__setattr__`, out of Keras's attribute tracking). An attribute
    a class or object did not hold itself is removed again, so that the
    one it inherits is seen. `label`: the owner's name in the record
    (default: a module's name).
    """
    label = label or getattr(owner, "__name__", type(owner).__name__)
    plain = isinstance(owner, (types.ModuleType, type))
    own = vars(owner)
    saved = {name: getattr(owner, name) for name in replacements}
    held = {name for name in replacements
            if isinstance(owner, types.ModuleType) or name in own}
    put = setattr if plain else object.__setattr__
    try:
        for name, fn in replacements.items():
            _record(label, name)
            put(owner, name, fn)
        yield saved
    finally:
        for name, fn in saved.items():
            if name in held:
                put(owner, name, fn)
            elif plain:
                delattr(owner, name)
            else:
                own.pop(name, None)
