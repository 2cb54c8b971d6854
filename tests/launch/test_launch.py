"""Tests of `keras_mirror.launch` with real worker processes on 127.0.0.1.

Every test is bounded by a pytest timeout, and the launcher's own
start-up and run timeouts; `no_leftover_processes` kills and reports any
process a test leaves behind.

Also the tests of `keras_mirror/launch/__init__.py`,
`keras_mirror/launch/_arguments.py`, `keras_mirror/launch/_ports.py`,
`keras_mirror/launch/_supervise.py`, `keras_mirror/launch/_workers.py`.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from support import helpers
from support.multi_worker import no_leftover_processes  # noqa: F401

from keras_mirror import launch as launch_lib
from keras_mirror.launch import _ports
from keras_mirror.launch import _supervise

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("processes")

WORKERS = helpers.WORKERS
TOY = [sys.executable, str(WORKERS / "toy_worker.py")]
MWMS = [sys.executable, str(WORKERS / "mwms_worker.py")]
REPO = helpers.ROOT


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _sleeper_pids(text):
    return [int(p) for p in re.findall(r"sleeping pid=(\d+)", text)]


@pytest.mark.timeout(60)
def test_two_workers_print_prefixed_task_index(capsys):
    code = launch_lib.launch(TOY + ["print"], 2, start_timeout=30)
    out, err = capsys.readouterr()
    assert code == 0
    lines = sorted(line for line in out.splitlines() if "task index" in line)
    assert [line[:23] for line in lines] == [
        "[worker 0] task index 0",
        "[worker 1] task index 1",
    ]
    clusters = {line.split(" of ")[1] for line in lines}
    assert len(clusters) == 1
    assert re.fullmatch(r"\['127.0.0.1:\d+', '127.0.0.1:\d+'\]", *clusters)
    assert "[worker 0] hello from stderr 0" in err
    assert "[worker 1] hello from stderr 1" in err


@pytest.mark.timeout(60)
def test_exit_code_propagates_and_others_are_stopped(capsys):
    started = time.monotonic()
    code = launch_lib.launch(TOY + ["fail", "1", "3"], 2, start_timeout=30)
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 3
    assert elapsed < 10
    assert "[launcher] worker 1 exited with code 3" in err
    assert "SIGKILL" not in err  # the sleeper obeyed SIGTERM
    (pid,) = _sleeper_pids(out)
    assert _gone(pid)


@pytest.mark.timeout(60)
def test_worker_ignoring_sigterm_is_sigkilled(capsys):
    code = launch_lib.launch(
        TOY + ["stubborn", "1"], 2, start_timeout=30, grace_period=1
    )
    out, err = capsys.readouterr()
    assert code == 1
    assert "[launcher] worker(s) 0 still running 1 s after SIGTERM" in err
    (pid,) = _sleeper_pids(out)
    assert _gone(pid)


@pytest.mark.timeout(60)
def test_restart_after_failure_succeeds(capsys):
    code = launch_lib.launch(
        TOY + ["fail-first"], 2, max_restarts=1, start_timeout=30
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert "[launcher] worker 1 exited with code 5" in err
    assert "[launcher] restarting all workers (1 restart(s) left)." in err
    assert "attempt 2 of 2" in err
    assert "[worker 0] attempt 1" in out
    assert "[worker 1] attempt 1" in out


@pytest.mark.timeout(60)
def test_no_restarts_left_returns_failing_code(capsys):
    code = launch_lib.launch(TOY + ["fail-first"], 2, start_timeout=30)
    _, err = capsys.readouterr()
    assert code == 5
    assert "restarting" not in err
    assert "[launcher] giving up; exit code 5." in err


@pytest.mark.timeout(60)
def test_start_timeout_names_workers_not_ready(capsys):
    started = time.monotonic()
    code = launch_lib.launch(
        TOY + ["ready-only", "0"], 2, start_timeout=2, grace_period=1
    )
    elapsed = time.monotonic() - started
    _, err = capsys.readouterr()
    assert code == launch_lib.START_TIMEOUT_EXIT_CODE == 125
    assert "[launcher] worker(s) 1 not ready within the start-up timeout" in err
    assert elapsed < 10


@pytest.mark.timeout(60)
def test_timeout_stops_the_run(capsys):
    started = time.monotonic()
    code = launch_lib.launch(
        TOY + ["sleep"], 2, timeout=2, start_timeout=30, grace_period=1
    )
    elapsed = time.monotonic() - started
    _, err = capsys.readouterr()
    assert code == launch_lib.TIMEOUT_EXIT_CODE == 124
    assert "[launcher] the run timed out" in err
    assert elapsed < 10


@pytest.mark.timeout(30)
def test_missing_program_is_reported(capsys):
    code = launch_lib.launch(["/nonexistent/keras-mirror-worker"], 2)
    _, err = capsys.readouterr()
    assert code == 127
    assert "[launcher] cannot start worker 0" in err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"command": "python train.py"}, "Received: command='python train.py'"),
        ({"command": []}, "Received: command=\\[\\]"),
        ({"num_workers": 0}, "Received: num_workers=0"),
        ({"num_workers": 1.5}, "Received: num_workers=1.5"),
        ({"max_restarts": -1}, "Received: max_restarts=-1"),
        ({"timeout": 0}, "Received: timeout=0"),
        ({"start_timeout": -1}, "Received: start_timeout=-1"),
        ({"grace_period": "5"}, "Received: grace_period='5'"),
    ],
)
def test_invalid_arguments(kwargs, message):
    args = {"command": TOY + ["print"], "num_workers": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        launch_lib.launch(**args)


@pytest.mark.timeout(60)
def test_cli_runs_script_after_double_dash(capsys):
    code = launch_lib.main(["-n", "2", "--"] + TOY + ["print"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "[worker 1] task index 1" in out


@pytest.mark.timeout(60)
def test_cli_runs_py_file_with_current_python(capsys):
    code = launch_lib.main(
        ["-n", "1", "--start-timeout", "0"] + TOY[1:] + ["print"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    assert "[worker 0] task index 0" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "2"], "a worker command is required"),
        (["-n", "0", "--", "python"],
         "`--nproc-per-node` must be an integer >= 1. Received: "
         "--nproc-per-node 0"),
        (["-n", "2", "--nnodes", "2", "--", "python"],
         "`--nnodes` must be 1: keras-mirror launch starts workers on this "
         "host only"),
        (["-n", "2", "--min-workers", "3", "--", "python"],
         "`--min-workers` must be at most `--nproc-per-node` (2). "
         "Received: --min-workers 3"),
        (["--", "python"], "the following arguments are required: -n"),
    ],
)
def test_cli_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        launch_lib.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: keras-mirror launch" in err


def test_mark_ready_writes_the_ready_file(tmp_path, monkeypatch):
    path = tmp_path / "worker-0.ready"
    monkeypatch.setenv(launch_lib.READY_FILE_ENV, str(path))
    assert launch_lib.mark_ready() is True
    assert path.read_text() == f"{os.getpid()}\n"
    assert launch_lib.mark_ready() is True
    assert [p.name for p in tmp_path.iterdir()] == ["worker-0.ready"]


def test_mark_ready_outside_the_launcher_does_nothing(monkeypatch):
    monkeypatch.delenv(launch_lib.READY_FILE_ENV, raising=False)
    assert launch_lib.mark_ready() is False


def _launch_sleepers(log, worker, *options):
    """`keras-mirror launch -n 2` of two sleeping toy workers, once both
    sleep; its output goes to `log`."""
    command = [sys.executable, "-m", "keras_mirror.cli", "launch", "-n", "2",
               "--start-timeout", "0", *options, "--", *worker, "sleep"]
    with open(log, "wb") as out:
        launcher = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 60
    while len(_sleeper_pids(log.read_text())) < 2:
        if time.monotonic() > deadline or launcher.poll() is not None:
            launcher.kill()
            launcher.wait(10)
            pytest.fail(log.read_text())
        time.sleep(0.1)
    return launcher


def test_sigterm_to_launcher_stops_its_workers(tmp_path):
    log = tmp_path / "out.txt"
    launcher = _launch_sleepers(log, TOY)
    try:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
        assert all(_gone(pid) for pid in _sleeper_pids(log.read_text()))
        assert "stopped by signal 15" in log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        for pid in _sleeper_pids(log.read_text()):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
def test_real_multi_worker_strategy_marks_ready_and_all_reduces(capsys):
    code = launch_lib.launch(MWMS, 2, timeout=75, start_timeout=60)
    out, err = capsys.readouterr()
    assert code == 0, out[-2000:] + err[-8000:]
    assert "[launcher] all 2 worker(s) ready after" in err
    assert "[worker 0] all-reduce sum=2" in out
    assert "[worker 1] all-reduce sum=2" in out


@pytest.mark.timeout(90)
def test_missing_peer_fails_within_start_timeout(capsys):
    # Only task 0 of a 2-worker cluster is started; no one listens on the
    # port of task 1, so building the strategy waits for it forever.
    addresses = [f"127.0.0.1:{p}" for p in _ports.free_ports(2)]
    started = time.monotonic()
    code, may_restart, _ = _supervise.run_attempt(
        MWMS, addresses, [0], attempt=0, start_timeout=15, grace_period=1
    )
    elapsed = time.monotonic() - started
    _, err = capsys.readouterr()
    assert (code, may_restart) == (launch_lib.START_TIMEOUT_EXIT_CODE, True)
    assert "[launcher] worker(s) 0 not ready within the start-up timeout" in err
    assert elapsed < 30


@pytest.mark.timeout(90)
def test_busy_port_is_reported(capsys, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        free = _ports.free_ports(1)
        monkeypatch.setattr(_ports, "free_ports", lambda n: [port] + free)
        code = launch_lib.launch(
            MWMS, 2, timeout=75, start_timeout=60, grace_period=1
        )
    _, err = capsys.readouterr()
    assert code == 1, err[-3000:]
    assert (
        f"[launcher] worker 0 exited with code 1; its address "
        f"127.0.0.1:{port} is in use by another process"
    ) in err


def test_launcher_import_does_not_load_tensorflow():
    """`keras-mirror launch` only starts processes: importing it must not
    pay TensorFlow's start-up (seconds), while the public names still
    resolve on first use."""
    code = (
        "import sys, keras_mirror, keras_mirror.launch\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
        "keras_mirror.cluster.parse_cluster\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow via cluster'\n"
        "assert keras_mirror.MirroredModel.__name__ == 'MirroredModel'\n"
        "assert 'tensorflow' in sys.modules\n"
        "import keras_mirror.replica_context\n"
        "assert callable(keras_mirror.replica_context), 'module shadows'\n"
        "assert keras_mirror.replica_context().num_replicas == 1\n"
        "assert sorted(keras_mirror.__all__) == sorted(['MirroredModel', "
        "'ReplicaContext', 'ReplicaTensorBoard', 'StepBackup', "
        "'__version__', 'errors', 'init', 'load_model', 'logical_cpus', "
        "'replica_context', 'VerifyReport'])\n"
        "for name in keras_mirror.__all__: getattr(keras_mirror, name)\n"
        "try:\n"
        "    keras_mirror.nothing\n"
        "except AttributeError as e:\n"
        "    assert str(e) == \"module 'keras_mirror' has no attribute "
        "'nothing'\"\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", helpers.lean(code)],
                          capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP])
def test_launcher_killed_or_hung_up_leaves_no_orphan(tmp_path, signum):
    # SIGKILL runs no handler: Linux's PR_SET_PDEATHSIG, set in each
    # worker, kills it. SIGHUP (a closed terminal) stops the workers as
    # SIGTERM does.
    log = tmp_path / "out.txt"
    launcher = _launch_sleepers(
        log, ["python", str(WORKERS / "toy_worker.py")], "--grace-period", "1")
    try:
        pids = _sleeper_pids(log.read_text())
        launcher.send_signal(signum)
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"orphans: {pids}"
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.wait()
        for pid in _sleeper_pids(log.read_text()):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == -signum if signum == signal.SIGKILL \
        else 128 + signum


@pytest.mark.timeout(60)
def test_worker_failing_twice_shrinks_the_group_to_min_workers(capsys):
    code = launch_lib.main(["-n", "3", "--min-workers", "2",
                            "--max-restarts", "2", "--start-timeout", "0",
                            "--grace-period", "1", "--", *TOY,
                            "always-fail", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.count("worker 2 exited with code 7") == 2
    assert ("[launcher] worker 2 failed in two attempts in a row; "
            "continuing with 2 worker(s) (--min-workers 2).") in err
    assert "attempt 3 of 3: starting 2 worker(s)" in err
    assert sorted(re.findall(r"\[worker \d\] size 2", out)) == [
        "[worker 0] size 2", "[worker 1] size 2"]


def test_next_size_shrinks_only_for_a_repeated_failure():
    assert _supervise.next_size(3, 2, None, 2) == 3
    assert _supervise.next_size(3, 2, 1, 2) == 3
    assert _supervise.next_size(3, 2, 2, 2) == 2
    assert _supervise.next_size(2, 1, 1, 2) == 2
    assert _supervise.next_size(3, 2, 2, None) == 3


def test_group_shrinks_then_grows_back_after_a_preemption(monkeypatch):
    results = iter([
        (7, True, 2),  # worker 2 fails
        (7, True, 2),  # ... again: drop one worker
        (launch_lib.PREEMPTED_EXIT_CODE, True, None),  # grow back
        (0, False, None),
    ])
    sizes = []

    def attempt(command, addresses, tasks, *args):
        sizes.append(len(tasks))
        return next(results)

    monkeypatch.setattr(_supervise, "run_attempt", attempt)
    code = launch_lib.launch(["python", "x.py"], 3, max_restarts=2,
                             min_workers=2)
    assert (code, sizes) == (0, [3, 3, 2, 3])


def _helper_pids(text):
    return [int(p) for p in re.findall(r"helper pid=(\d+)", text)]


@pytest.mark.timeout(90)
def test_sigkilled_launcher_kills_what_workers_started_and_cleans_up(
        tmp_path):
    """Issue 23: a worker's own child (a data loader's helper) dies with a
    SIGKILLed launcher too, and its `keras-mirror-ready-*` folder goes."""
    log, scratch = tmp_path / "out.txt", tmp_path / "tmp"
    scratch.mkdir()
    command = [sys.executable, "-m", "keras_mirror.cli", "launch", "-n", "2"]
    command += ["--start-timeout", "0", "--grace-period", "1", "--"]
    command += ["python", str(WORKERS / "toy_worker.py"), "spawn"]
    env = dict(os.environ, TMPDIR=str(scratch))
    with open(log, "wb") as out:
        launcher = subprocess.Popen(command, stdout=out, env=env,
                                    stderr=subprocess.STDOUT, cwd=REPO)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while len(_sleeper_pids(log.read_text())) < 2:
            assert time.monotonic() < deadline, log.read_text()
            assert launcher.poll() is None, log.read_text()
            time.sleep(0.1)
        pids = _sleeper_pids(log.read_text()) + _helper_pids(log.read_text())
        assert len(pids) == 4
        assert [p.name[:19] for p in scratch.iterdir()] == [
            "keras-mirror-ready-"]
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) or list(scratch.iterdir()):
            assert time.monotonic() < deadline, (
                f"left: {[p for p in pids if not _gone(p)]}, "
                f"{list(scratch.iterdir())}")
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_guard_exits_after_a_normal_run(capsys):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert launch_lib.launch(TOY + ["print"], 2, start_timeout=30) == 0
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before
