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


@contextlib.contextmanager
def replaced_method(obj, name, make_hook, purpose, reason, owner=None):
    """Within the block, `obj.<name>` is `make_hook(<the class's bound
    method>)` (an optimizer's hooks, around a replica step's trace);
    recorded as `owner.<name>` with `reason` (see `replaced`)."""
    _require(obj, (name,), type(obj).__name__, purpose)
    original = getattr(type(obj), name).__get__(obj)
    with replaced(obj, {name: make_hook(original)}, reason,
                  label=owner or type(obj).__name__):
        yield


# Every Keras or TF attribute keras-mirror replaces goes through `replaced`
# (or `note_replaced`, for state that follows a re-homed variable), which
# names it `<owner>.<name>` (a module's import name, or for an object the
# Keras class that defines the attribute) with its reason, and restores it
# when the block is left: nothing is replaced for longer than the block
# that needs it, nothing is added to a class for good.
# `docs/architecture.md` lists them; `tests/compat/test_base.py` records
# what `fit` replaces for several models and checks that list against it;
# `tests/test_seam.py` checks that every class and module is as before.
_RECORDS = []


class Record(set):
    """The labels replaced within a `recording()` block (a set), with
    `reasons`: each label's reason."""

    def __init__(self):
        super().__init__()
        self.reasons = {}


@contextlib.contextmanager
def recording():
    """Within the block, collects the label of every replacement made."""
    seen = Record()
    _RECORDS.append(seen)
    try:
        yield seen
    finally:
        _RECORDS.remove(seen)


def _record(owner, name, reason):
    if not reason:
        raise ValueError(
            "Every replacement of a Keras or TensorFlow attribute needs its "
            f"reason. Received: reason={reason!r} for `{owner}.{name}`")
    for seen in _RECORDS:
        seen.add(f"{owner}.{name}")
        seen.reasons[f"{owner}.{name}"] = reason


def note_replaced(owner, name, reason):
    """Records a replacement made without `replaced`: state that follows a
    variable's re-homing (its backing, an optimizer's index of them)."""
    _record(owner, name, reason)


_MISSING = object()


@contextlib.contextmanager
def replaced(owner, replacements, reason, label=None):
    """Within the block, `owner.<name>` is `replacements[name]`.

    `owner`: a module or a class (`setattr`), or an object (set with
    `object.__setattr__`, out of Keras's attribute tracking). `reason`:
    why, recorded with the label (see `recording`). On leaving, each
    attribute is restored exactly: the very object the owner held itself
    (a class's descriptor, not what `getattr` makes of it), and an
    attribute it did not hold is removed again, so that the one it
    inherits is seen. `label`: the owner's name in the record (default: a
    module's or class's name).
    """
    label = label or getattr(owner, "__name__", type(owner).__name__)
    plain = isinstance(owner, (types.ModuleType, type))
    own = vars(owner)
    saved = {name: own.get(name, _MISSING) for name in replacements}
    put = setattr if plain else object.__setattr__
    try:
        for name, fn in replacements.items():
            _record(label, name, reason)
            put(owner, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            if fn is not _MISSING:
                put(owner, name, fn)
            elif plain:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                own.pop(name, None)
