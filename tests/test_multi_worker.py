"""MirroredModel on MultiWorkerMirroredStrategy with real worker processes.

Two workers x two logical CPUs each (4 replicas), started by
`keras_mirror.launch.launch` on 127.0.0.1, train `mw_train.model()` on 45
rows with global batch 8 (uneven last batch); both workers' final weights
must equal each other and single-device Keras training on the same global
batches. One launch (a module-scoped fixture) trains the three models one
after another in each worker; each test asserts on one model's files.
Bounded by the launcher's timeouts and a pytest timeout.
"""

import contextlib
import importlib.util
import io
import json
import pathlib
import sys

import numpy as np
import psutil
import pytest

from keras_mirror import launch as launch_lib

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("workers")

WORKER = pathlib.Path(__file__).parent / "workers" / "mw_train.py"


def worker_module():
    spec = importlib.util.spec_from_file_location("mw_train", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_leftover_processes():
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


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))

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


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    """One launch of 2 workers that trains the dense, conv and embedding
    models one after another (one start-up and one strategy per worker);
    returns (out dir, exit code, stdout, stderr). Each model's files are in
    `out/<kind>/`."""
    out = tmp_path_factory.mktemp("three_models")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        code = launch_lib.launch(
            [sys.executable, str(WORKER), str(out), "--model",
             "dense,conv,embedding", "--epochs", "2,1,1"], 2, timeout=240,
            start_timeout=90, grace_period=2)
    return out, code, stdout.getvalue(), stderr.getvalue()


@pytest.mark.timeout(300)
def test_two_workers_train_like_one_device(three_models):
    tmp_path, code, out, err = three_models
    assert code == 0, out + err
    assert "multi-worker: 2 workers x 2 replicas; input: every worker " \
        "reads the full global batch and keeps its replicas' rows" in err
    tmp_path = tmp_path / "dense"
    gap = assert_equal_single_device(tmp_path)
    info = [json.loads((tmp_path / f"info_{i}.json").read_text())
            for i in (0, 1)]
    assert [i["is_chief"] for i in info] == [True, False]
    assert [i["local_replica_ids"] for i in info] == [[0, 1], [2, 3]]
    assert {i["num_workers"] for i in info} == {2}
    assert {i["num_replicas"] for i in info} == {4}
    # Rows per replica per epoch, gathered in global replica order: five
    # batches of 8 split (2, 2, 2, 2) and one of 5 split (2, 1, 1, 1).
    assert info[1]["replica_samples"] == [[12, 11, 11, 11]] * 2
    # Only the chief saved.
    assert (tmp_path / "final.weights.h5").exists()
    print(f"max |w_worker - w_single| = {gap:.3g}; "
          f"first step after {info[0]['seconds_to_first_step']:.1f} s")


@pytest.mark.timeout(300)
def test_a_worker_whose_rows_are_all_empty_runs_stand_ins(three_models):
    # 42 rows, batch 8: the last batch's 2 rows go to worker 0's replicas;
    # worker 1's replicas run stand-in rows through the convolution.
    tmp_path, code, out, err = three_models
    assert code == 0, out + err
    assert_equal_single_device(tmp_path / "conv", epochs=1, steps=6,
                               kind="conv")
    info = json.loads((tmp_path / "conv" / "info_1.json").read_text())
    assert info["replica_samples"] == [[11, 11, 10, 10]]


@pytest.mark.timeout(300)
def test_sparse_embedding_gradients_are_gathered_across_workers(
        three_models):
    # Embedding gradients are IndexedSlices: each replica's rows are
    # all-gathered across both workers (not densified and summed), so that
    # Adam sees every row's value as on one device, duplicates included.
    tmp_path, code, out, err = three_models
    assert code == 0, out + err
    assert_equal_single_device(tmp_path / "embedding", epochs=1, steps=6,
                               kind="embedding")
