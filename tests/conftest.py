"""Test set-up: 4 logical CPU devices, seeded RNGs, a clean Keras session.

TensorFlow fixes its device list on first use, so the CPU is split here,
once, before any test imports a model.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

import keras_mirror  # noqa: E402

NUM_CPUS = 4
CPUS = keras_mirror.logical_cpus(NUM_CPUS)


@pytest.fixture(autouse=True)
def _clean_session():
    keras.utils.set_random_seed(1234)
    yield
    keras.backend.clear_session()


@pytest.fixture
def cpus():
    """The names of the 4 logical CPU devices."""
    return list(CPUS)
