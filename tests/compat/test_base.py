"""`keras_mirror/_compat/_base.py`: one test per private attribute.

Each fails loudly when Keras or TensorFlow renames or removes what it
checks.
"""

import keras
import pytest

from keras_mirror import _compat


def test_supported_keras_version():
    _compat.check_keras_version()


def test_other_backend_is_refused_at_construction(monkeypatch):
    import keras_mirror

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError) as info:
        keras_mirror.MirroredModel(model)
    assert str(info.value) == (
        "keras-mirror needs Keras's TensorFlow backend (it trains on "
        "`tf.distribute`). Set `KERAS_BACKEND=tensorflow` (or "
        '`"backend": "tensorflow"` in ~/.keras/keras.json) before importing '
        "Keras. Received: keras.backend.backend()='jax'")


def test_a_missing_private_name_fails_loudly_by_name():
    with pytest.raises(RuntimeError, match=r"has no `Variable\._value`; "
                       r"keras-mirror cannot move it\. Install a supported "
                       r"Keras"):
        _compat._require(object(), ("_value",), "Variable", "move it")
    opt = keras.optimizers.SGD()
    with pytest.raises(RuntimeError, match=r"SGD\._no_such_hook"):
        _compat._replace_method(opt, "_no_such_hook", lambda f: f, "hook")
