"""Test set-up: 4 logical CPU devices, seeded RNGs, a clean Keras session.

TensorFlow fixes its device list on first use, so the CPU is split here,
once, before any test imports a model.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import gc  # noqa: E402

import pytest  # noqa: E402
from support import xdist_groups  # noqa: E402

NUM_CPUS = 4
CPUS = []  # the logical CPU devices' names, set by `pytest_configure`


def _xdist_controller(config):
    """Whether this process only hands the tests to pytest-xdist workers."""
    return bool(getattr(config.option, "numprocesses", 0)) and not hasattr(
        config, "workerinput")


def pytest_configure(config):
    """Splits the CPU in each process that runs tests, before any test
    module is imported.

    The xdist controller runs none: it skips TensorFlow's start-up (about
    5 CPU-s, measured, while no worker has started yet).
    """
    if _xdist_controller(config):
        return
    import keras_mirror

    CPUS[:] = keras_mirror.logical_cpus(NUM_CPUS)
    # TensorFlow and Keras leave ~365,000 objects behind their imports; a
    # full collection walks them all (about 1.5 s idle, 3 s loaded), and
    # Keras's `clear_session()` runs one after every test. Frozen, they are
    # never walked again: a collection sees only what the tests made since.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _clean_session():
    import keras

    keras.utils.set_random_seed(1234)
    yield
    # Keras's graph state goes after every test; the objects it leaves in
    # cycles go once per module (below), not after every test.
    keras.backend.clear_session(free_memory=False)


@pytest.hookimpl(trylast=True)  # after the module's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Collects the cycles a module's tests left, once per module."""
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()


@pytest.fixture(scope="module")
def one_device():
    """One device's runs of a module's cases, by key (`support.helpers.once`):
    a test that runs on both execution paths compares both with the same
    run. A module that uses it is one xdist group
    (`support/xdist_groups.py`), so that each run happens once."""
    return {}


@pytest.fixture
def cpus():
    """The names of the 4 logical CPU devices."""
    return list(CPUS)


@pytest.fixture(params=["strategy"])
def execution(request, monkeypatch):
    """The execution path of `MirroredModel` a test runs on.

    There is one path, `"strategy"`; the fixture pins it explicitly, so a
    test that names it (or a module that opts in with
    `pytestmark = pytest.mark.usefixtures("execution")`) says which code it
    proves.
    """
    import keras_mirror

    init = keras_mirror.MirroredModel.__init__

    def on_path(self, *args, execution="auto", **kwargs):
        if execution == "auto":
            execution = request.param
        init(self, *args, execution=execution, **kwargs)

    monkeypatch.setattr(keras_mirror.MirroredModel, "__init__", on_path)
    return request.param


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Keeps a module with a module-scoped fixture on one xdist worker."""
    xdist_groups.group_module_fixtures(items)
