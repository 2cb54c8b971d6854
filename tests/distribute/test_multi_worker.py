"""MirroredModel on MultiWorkerMirroredStrategy with real worker processes.

Two workers x two logical CPUs each (4 replicas), started by
`keras_mirror.launch.launch` on 127.0.0.1, train `mw_train.model()` on 45
rows with global batch 8 (uneven last batch); both workers' final weights
must equal each other and single-device Keras training on the same global
batches. Bounded by the launcher's timeouts and a pytest timeout.
"""

import json

import pytest
from support.multi_worker import assert_equal_single_device
from support.multi_worker import no_leftover_processes  # noqa: F401
from support.multi_worker import run_workers

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("workers")

@pytest.mark.timeout(100)
def test_two_workers_train_like_one_device(tmp_path, capsys):
    code = run_workers(tmp_path, "--epochs", "2")
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "multi-worker: 2 workers x 2 replicas; input: every worker " \
        "reads the full global batch and keeps its replicas' rows" in err
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


@pytest.mark.timeout(100)
def test_a_worker_whose_rows_are_all_empty_runs_stand_ins(tmp_path, capsys):
    # 42 rows, batch 8: the last batch's 2 rows go to worker 0's replicas;
    # worker 1's replicas run stand-in rows through the convolution.
    code = run_workers(tmp_path, "--epochs", "1", "--model", "conv")
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert_equal_single_device(tmp_path, epochs=1, steps=6, kind="conv")
    info = json.loads((tmp_path / "info_1.json").read_text())
    assert info["replica_samples"] == [[11, 11, 10, 10]]


@pytest.mark.timeout(100)
def test_sparse_embedding_gradients_are_gathered_across_workers(
        tmp_path, capsys):
    # Embedding gradients are IndexedSlices: each replica's rows are
    # all-gathered across both workers (not densified and summed), so that
    # Adam sees every row's value as on one device, duplicates included.
    code = run_workers(tmp_path, "--epochs", "1", "--model", "embedding")
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert_equal_single_device(tmp_path, epochs=1, steps=6,
                               kind="embedding")
