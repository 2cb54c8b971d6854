"""Shared by the tests that train `workers/mw_train.py` on real workers.

`tests/distribute/test_multi_worker.py` and
`tests/callbacks/test_step_backup.py` start two workers with
`keras_mirror.launch.launch` and compare their weights with one device's.
"""

import importlib.util
import sys

import numpy as np
import psutil
import pytest

from keras_mirror import launch as launch_lib
from support import helpers
from support.helpers import max_diff

WORKER = helpers.WORKERS / "mw_train.py"


def worker_module():
    spec = importlib.util.spec_from_file_location("mw_train", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    children = psutil.Process().children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=10)
    assert not children, f"the test left processes behind: {children}"


def single_device_weights(epochs, kind="dense"):
    mw = worker_module()
    model = mw.model(kind)
    model.compile(optimizer=mw.optimizer(), loss="mse")
    x, y = mw.data(kind)
    model.fit(x, y, batch_size=mw.BATCH, epochs=epochs, shuffle=False,
              verbose=0)
    return model.get_weights(), int(model.optimizer.iterations.numpy())


def load(out, index):
    with np.load(out / f"weights_{index}.npz") as f:
        weights = [f[f"arr_{i}"] for i in range(len(f.files) - 1)]
        return weights, int(f["iterations"])


def assert_equal_single_device(out, epochs=2, steps=12, kind="dense"):
    """Both workers end on the same weights as one device; returns the gap.
    """
    w0, it0 = load(out, 0)
    w1, it1 = load(out, 1)
    ref, ref_it = single_device_weights(epochs, kind)
    assert it0 == it1 == ref_it == steps
    assert max_diff(w0, w1) == 0.0
    gap = max_diff(w0, ref)
    assert gap < 1e-5
    return gap


def run_workers(out, *args, max_restarts=0):
    return launch_lib.launch(
        [sys.executable, str(WORKER), str(out), *args], 2,
        max_restarts=max_restarts, timeout=80, start_timeout=45,
        grace_period=2)


def worker_stub(position, workers=2, n_local=2):
    """What `distribute._worker_input` reads of a wrapper on worker
    `position` of `workers`, each with `n_local` replicas."""
    import types

    first = position * n_local
    return types.SimpleNamespace(
        local_replica_ids=tuple(range(first, first + n_local)),
        num_replicas=workers * n_local, devices=("a",) * n_local,
        batch_mode="global", worker_input="shard", num_workers=workers)
