"""Elastic, exact: a worker that dies for good, and the group shrinks.

`keras-mirror launch -n 3 --min-workers 2 --max-restarts 3`: worker 2 is
SIGKILLed after step 4 on every attempt (a host lost for good). Attempt 1
resumes from the step backup and loses worker 2 again; attempt 2 runs on
2 workers, resumes from the backup and finishes. Because a step does not
depend on the number of replicas (global-batch semantics), the final
weights equal uninterrupted single-device training, with 12 optimizer
steps: none lost or repeated.
"""

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


@pytest.mark.timeout(280)
def test_group_shrinks_after_a_worker_dies_for_good_and_stays_exact(
        tmp_path, capsys):
    backup = tmp_path / "backup"
    code = launch_lib.launch(
        [sys.executable, str(WORKER), str(tmp_path), "--epochs", "2",
         "--local-cpus", "1", "--backup", str(backup), "--kill-at-step",
         "4", "--kill-worker", "2", "--kill-always"], 3,
        max_restarts=3, min_workers=2, timeout=260, start_timeout=90,
        grace_period=2)
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-5000:]
    assert "[worker 2] killing myself after step 4" in out
    assert "[worker 2] killing myself after step 5" in out
    assert ("worker 2 failed in two attempts in a row; continuing with 2 "
            "worker(s) (--min-workers 2).") in err
    assert "StepBackup resumes at epoch 0, step 5 (optimizer step 5)" in out
    infos = [json.loads((tmp_path / f"info_{i}.json").read_text())
             for i in (0, 1)]
    # Attempt 2, or later if a port was taken by another process meanwhile
    # (the one restart of margin).
    assert [i["num_workers"] for i in infos] == [2, 2]
    assert infos[0]["attempt"] == infos[1]["attempt"] >= 2
    gap = assert_equal_single_device(tmp_path)
    print(f"3 -> 3 -> 2 workers: max |w - w_single| = "
          f"{gap:.3g}")
