"""The version range and the checks every `_compat` module uses."""

import contextlib

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


def _replace_method(obj, name, make_hook, purpose):
    """Sets `obj.<name>` to `make_hook(<the class's bound method>)`."""
    _require(obj, (name,), type(obj).__name__, purpose)
    original = getattr(type(obj), name).__get__(obj)
    setattr(obj, name, make_hook(original))


@contextlib.contextmanager
def replaced(module, replacements):
    """Within the block, `module.<name>` is `replacements[name]`."""
    saved = {name: getattr(module, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(module, name, fn)
        yield saved
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
