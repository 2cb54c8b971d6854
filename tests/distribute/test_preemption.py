"""Preemption with real workers: SIGTERM to one worker of two.

Worker 1 sends itself SIGTERM after global step 5 (mid-epoch 0 of two
6-step epochs; backups only every 4 steps). Every worker must finish the
step in flight, stop after the same step, write the step backup there and
exit with the restartable code 75; the launcher restarts the group
(without using up `--max-restarts`), and the resumed run ends on the
single-device weights with no step lost or repeated.
"""

import sys

import pytest
from support.multi_worker import WORKER
from support.multi_worker import assert_equal_single_device
from support.multi_worker import no_leftover_processes  # noqa: F401

from keras_mirror import launch as launch_lib

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("workers")


@pytest.mark.timeout(150)
def test_sigterm_to_one_worker_stops_all_after_one_step_and_resumes(
        tmp_path, capsys):
    backup = tmp_path / "backup"
    code = launch_lib.launch(
        [sys.executable, str(WORKER), str(tmp_path), "--epochs", "2",
         "--backup", str(backup), "--backup-every", "4",
         "--sigterm-at-step", "5"], 2,
        max_restarts=0, timeout=140, start_timeout=60, grace_period=2)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "[worker 1] SIGTERM to myself after step 5" in out
    for i in (0, 1):
        assert (f"[worker {i}] keras-mirror: preempted (SIGTERM to a "
                "worker): every worker stopped after epoch 0 step 6;") in err
    assert "was preempted (exit code 75" in err
    assert "restarting all workers after the preemption" in err
    # Stopped after the last batch of epoch 0, before its end-of-epoch
    # callbacks: the resume finishes epoch 0, then trains epoch 1.
    assert "StepBackup resumes at epoch 0, step 6 (optimizer step 6)" in out
    gap = assert_equal_single_device(tmp_path)
    print(f"after SIGTERM + restart: max |w - w_single| = "
          f"{gap:.3g}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("phase, stopped, resumed", [
    # Before any step: kept, acted on after the first step.
    ("build", "after epoch 0 step 1", "epoch 0, step 1 (optimizer step 1)"),
    # After the last step: every worker stops, the backup of the finished
    # run kept; the restarted run finds the training done.
    ("end", "at the end of training", "epoch 2, step 0 (optimizer step 12)"),
])
def test_sigterm_outside_the_steps_is_not_lost(tmp_path, capsys, phase,
                                               stopped, resumed):
    backup = tmp_path / "backup"
    code = launch_lib.launch(
        [sys.executable, str(WORKER), str(tmp_path), "--epochs", "2",
         "--backup", str(backup), "--backup-every", "4",
         "--sigterm-in", phase], 2,
        max_restarts=0, timeout=140, start_timeout=60, grace_period=2)
    out, err = capsys.readouterr()
    assert code == 0, out + err
    for i in (0, 1):
        assert (f"[worker {i}] keras-mirror: preempted (SIGTERM to a "
                f"worker): every worker stopped {stopped};") in err, err
    assert "restarting all workers after the preemption" in err
    assert f"StepBackup resumes at {resumed}" in out
    gap = assert_equal_single_device(tmp_path)
    print(f"SIGTERM in {phase} + restart: max |w - w_single| = {gap:.3g}")


def test_watch_catches_one_sigterm_and_restores_the_handler():
    import os
    import signal

    from keras_mirror.distribute import _preemption

    previous = signal.getsignal(signal.SIGTERM)
    watch = _preemption.Watch()
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.signalled
    watch.close()
    assert signal.getsignal(signal.SIGTERM) is previous
