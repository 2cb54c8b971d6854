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
import io
import json
import sys

import pytest
from support.multi_worker import WORKER
from support.multi_worker import assert_equal_single_device
from support.multi_worker import no_leftover_processes  # noqa: F401

from keras_mirror import launch as launch_lib

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("workers")

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
