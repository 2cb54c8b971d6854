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


@pytest.fixture(params=["in_graph", "strategy"])
def execution(request, monkeypatch):
    """Runs a test once per execution path of `MirroredModel`.

    Every `MirroredModel` the test builds with the default
    `execution="auto"` runs on the path under test instead, so that a test
    module opts in with `pytestmark = pytest.mark.usefixtures("execution")`
    and proves both paths exact with the same assertions.
    """
    init = keras_mirror.MirroredModel.__init__

    def on_path(self, *args, execution="auto", **kwargs):
        if execution == "auto":
            execution = request.param
        init(self, *args, execution=execution, **kwargs)

    monkeypatch.setattr(keras_mirror.MirroredModel, "__init__", on_path)
    return request.param
