"""`keras-mirror launch`: start N local workers of a script with `TF_CONFIG`.

```
keras-mirror launch --nproc-per-node 2 [--cpus-per-worker C]
    [--max-restarts K] [--min-workers M] [--timeout S] [--start-timeout S]
    [--grace-period S] -- python train.py args...
```

Flags follow `torchrun` where they mean the same: `-n`/`--nproc-per-node`
(also `--num-workers`), `--max-restarts`, `--nnodes` (must be 1: the
launcher starts workers on this host only). Errors name the flag.

Starts `N` worker processes of the command on this host. `python` (or
`python3`) as the first word means the launcher's own interpreter, and a
first word ending in `.py` runs with it. Worker `i` gets:

- `TF_CONFIG={"cluster": {"worker": ["127.0.0.1:p0", ...]},
  "task": {"type": "worker", "index": i}}`, on ports that were free when
  the launcher picked them (by binding port 0);
- `KERAS_MIRROR_RESTART`: the attempt number, 0 at first, 1 after the
  first restart, and so on;
- `KERAS_MIRROR_READY_FILE`: a path of its own (see "Readiness" below);
- `KERAS_MIRROR_CPUS_PER_WORKER` with `--cpus-per-worker`: the logical
  CPU replicas `import keras_mirror` gives the worker on a host without
  GPUs;
- `PYTHONUNBUFFERED=1` unless set, so that output streams as it is printed.

Each line a worker prints is copied to the launcher's stdout (or stderr)
as `[worker i] line`; the launcher's own messages go to stderr as
`[launcher] ...`.

Failures. When any worker exits with a non-zero code, the launcher stops
the others: SIGTERM to each worker's process group, then SIGKILL after the
grace period (TensorFlow ignores SIGTERM while it waits in a collective).
If restarts remain, the whole group starts again on new ports; else the
launcher returns the first failing code (`128 + signal` for a worker
killed by a signal). A port taken by another process between the pick and
the worker's bind (a race no launcher can close) fails that worker with
TensorFlow's `Could not start gRPC server`; the launcher then names the
busy port, and a restart picks new ports.

Preemption. A worker that exits with `PREEMPTED_EXIT_CODE` (75) was
preempted: with a `StepBackup`, every worker stops after the same step
and the backup is written (see `keras_mirror.distribute._preemption`).
The launcher
waits for the others to exit, then restarts the group at its full size;
this does not count against `--max-restarts`.

Elastic. With `--min-workers M`, when the same worker index fails in two
attempts in a row, the next attempt runs one worker fewer (down to M);
with a `StepBackup` the run resumes where it stopped, and stays exact on
any number of workers (a step does not depend on the replica count).

The launcher's death. SIGTERM, SIGHUP and Ctrl-C stop every worker before
the launcher exits with `128 + signal`. A launcher killed outright
(SIGKILL) cannot clean up: each worker asks Linux for SIGKILL when its
parent dies (`PR_SET_PDEATHSIG`), so none is left running.

Readiness. A worker is ready once it has created the file named by
`KERAS_MIRROR_READY_FILE`, which `keras_mirror.init()` (run by
`import keras_mirror` in a cluster) and `MirroredModel` do as soon as the
strategy is built; building a `MultiWorkerMirroredStrategy` waits until
every peer has joined, so a ready worker is one whose cluster is
complete. Scripts that build their own strategy call
`keras_mirror.launch.mark_ready()` after it. A worker that exits also
counts as ready. If some worker is not ready within the start-up timeout
(a missing or unreachable peer makes TensorFlow wait forever, silently),
the launcher names the workers that were not ready, stops the group and
exits with `START_TIMEOUT_EXIT_CODE` (125), or restarts if restarts
remain. `--start-timeout 0` turns the check off. `--timeout` bounds the
whole run, restarts included; when it expires the launcher stops every
worker and exits with `TIMEOUT_EXIT_CODE` (124), without restarting.

Separate hosts. The launcher only starts local workers. On several hosts,
set `TF_CONFIG` by hand on each host (the same `"cluster"` everywhere,
each host's own `"task"` index), or run under Slurm (`srun`) or a
Kubeflow `TFJob`; see the README's "Multi-worker" section.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from keras_mirror.distribute import _multi_worker
from keras_mirror.distribute import cluster as cluster_lib

READY_FILE_ENV = _multi_worker.READY_FILE_ENV
CPUS_ENV = _multi_worker.CPUS_ENV
RESTART_ENV = "KERAS_MIRROR_RESTART"
PREEMPTED_EXIT_CODE = _multi_worker.PREEMPTED_EXIT_CODE
_PR_SET_PDEATHSIG = 1
TIMEOUT_EXIT_CODE = 124
START_TIMEOUT_EXIT_CODE = 125
DEFAULT_START_TIMEOUT = 300.0
DEFAULT_GRACE_PERIOD = 5.0
_POLL_SECONDS = 0.05
_PUMP_JOIN_SECONDS = 2.0
_OUTPUT_LOCK = threading.Lock()


def mark_ready():
    """Tells `keras-mirror launch` that this worker has started.

    An alias of `keras_mirror.init`'s readiness signal, kept for scripts
    that build their own `MultiWorkerMirroredStrategy`: call it after
    building it. Outside the launcher it does nothing. Returns `True` if a
    ready file was written.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras_mirror.launch.mark_ready()
    ```
    """
    return _multi_worker.mark_ready()


def _say(message):
    """Writes one launcher message to stderr."""
    with _OUTPUT_LOCK:
        sys.stderr.write(f"[launcher] {message}\n")
        sys.stderr.flush()


def _pump(pipe, stream_name, prefix):
    """Copies lines from a worker's pipe to our stream, with a prefix."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            with _OUTPUT_LOCK:
                stream = getattr(sys, stream_name)
                try:
                    stream.write(f"{prefix} {line}\n")
                    stream.flush()
                except (OSError, ValueError):
                    pass


def _free_ports(n):
    """Returns `n` distinct TCP ports that are free on all interfaces now.

    The sockets are closed before the workers bind the ports, so another
    process may take one in between; `_describe_failure` reports that.
    """
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("0.0.0.0", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _exit_status(returncode):
    """A shell-style exit status: `128 + signal` for a killed process."""
    return 128 - returncode if returncode < 0 else returncode


class _Worker:
    """One worker process, its output pumps and its ready file."""

    def __init__(self, index, command, env, ready_file):
        self.index = index
        self.ready_file = ready_file
        self.ready = False
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        prefix = f"[worker {index}]"
        self.pumps = [
            threading.Thread(
                target=_pump, args=(pipe, name, prefix), daemon=True
            )
            for pipe, name in (
                (self.process.stdout, "stdout"),
                (self.process.stderr, "stderr"),
            )
        ]
        for pump in self.pumps:
            pump.start()

    def signal(self, signum):
        """Sends `signum` to the worker's whole process group."""
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def update_ready(self):
        if not self.ready:
            self.ready = self.process.poll() is not None or os.path.exists(
                self.ready_file
            )
        return self.ready


def _die_with_parent(parent):
    """A `preexec_fn`: the worker gets SIGKILL when the launcher dies.

    Linux's `PR_SET_PDEATHSIG` covers a launcher killed by SIGKILL (no
    handler runs); each worker is also the leader of its own process
    group, which `_stop` signals as a whole. Elsewhere it does nothing.
    """
    libc_name = ctypes.util.find_library("c") if sys.platform.startswith(
        "linux") else None
    libc = ctypes.CDLL(libc_name, use_errno=True) if libc_name else None

    def preexec():
        if libc is None:
            return
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl
            os._exit(1)

    return preexec


def _worker_env(base, addresses, index, attempt, ready_file):
    env = dict(os.environ if base is None else base)
    env["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": list(addresses)},
            "task": {"type": "worker", "index": index},
        }
    )
    env[RESTART_ENV] = str(attempt)
    env[READY_FILE_ENV] = ready_file
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _stop(workers, grace_period):
    """SIGTERM to every live worker, SIGKILL to those left after the grace."""
    live = [w for w in workers if w.process.poll() is None]
    for worker in live:
        worker.signal(signal.SIGTERM)
    end = time.monotonic() + grace_period
    for worker in live:
        try:
            worker.process.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    stubborn = [w.index for w in live if w.process.poll() is None]
    if stubborn:
        _say(
            f"worker(s) {_names(stubborn)} still running {grace_period:g} s "
            "after SIGTERM; sending SIGKILL."
        )
    for worker in workers:
        worker.signal(signal.SIGKILL)
    for worker in workers:
        try:
            worker.process.wait(_PUMP_JOIN_SECONDS * 5)
        except subprocess.TimeoutExpired:
            _say(f"worker {worker.index} survived SIGKILL.")
    for worker in workers:
        for pump in worker.pumps:
            pump.join(_PUMP_JOIN_SECONDS)


def _names(indices):
    return ", ".join(str(i) for i in indices)


def _describe_failure(worker, addresses, code):
    message = f"worker {worker.index} exited with code {code}"
    port = int(addresses[worker.index].rpartition(":")[2])
    if not worker.ready and cluster_lib.port_in_use(port):
        message += (
            f"; its address {addresses[worker.index]} is in use by another "
            "process (the port was free when the launcher picked it and "
            "was taken before the worker could bind it; TensorFlow then "
            "fails with 'Could not start gRPC server')"
        )
    return message + "; stopping the other workers."


def _wait_preempted(workers, grace_period):
    """Gives the other workers of a preempted group time to exit too.

    Every worker finishes its step, the chief writes the step backup and
    all exit with `PREEMPTED_EXIT_CODE`; stopping them at once could kill
    the chief while it writes.
    """
    end = time.monotonic() + max(grace_period, 1.0) * 6
    while time.monotonic() < end and any(
            w.process.poll() is None for w in workers):
        time.sleep(_POLL_SECONDS)


def _supervise(workers, addresses, deadline, start_timeout, started,
               grace_period=DEFAULT_GRACE_PERIOD):
    """Waits for the group to succeed, fail or time out; returns a result.

    The result is `(exit_code, may_restart, failed_worker_index)`.
    """
    announced = False
    while True:
        codes = [w.process.poll() for w in workers]
        for worker, code in zip(workers, codes):
            if code == PREEMPTED_EXIT_CODE:
                _say(f"worker {worker.index} was preempted (exit code "
                     f"{code}: it finished its step and the step backup "
                     "was written); waiting for the others to do the same.")
                _wait_preempted(workers, grace_period)
                return code, True, None
            if code:
                code = _exit_status(code)
                _say(_describe_failure(worker, addresses, code))
                return code, True, worker.index
        if all(code == 0 for code in codes):
            return 0, False, None
        waiting = [w.index for w in workers if not w.update_ready()]
        if not waiting and not announced:
            announced = True
            _say(
                f"all {len(workers)} worker(s) ready after "
                f"{time.monotonic() - started:.1f} s."
            )
        if waiting and start_timeout is not None:
            if time.monotonic() >= started + start_timeout:
                _say(
                    f"worker(s) {_names(waiting)} not ready within the "
                    f"start-up timeout of {start_timeout:g} s: a worker is "
                    "ready once it has built its multi-worker strategy "
                    "(`import keras_mirror` does, and so does "
                    "MirroredModel; it waits for every peer); a missing or "
                    "unreachable peer keeps it waiting. Stopping all "
                    "workers."
                )
                return START_TIMEOUT_EXIT_CODE, True, None
        if deadline is not None and time.monotonic() >= deadline:
            _say(
                "the run timed out (`--timeout` of the whole run "
                "expired); stopping all workers."
            )
            return TIMEOUT_EXIT_CODE, False, None
        time.sleep(_POLL_SECONDS)


def _run_attempt(
    command,
    addresses,
    tasks,
    attempt,
    env=None,
    deadline=None,
    start_timeout=DEFAULT_START_TIMEOUT,
    grace_period=DEFAULT_GRACE_PERIOD,
):
    """Runs the tasks `tasks` of the worker cluster `addresses` once.

    Returns `(exit_code, may_restart, failed_worker_index)`. Every worker
    has exited, killed if need be, when it returns.
    """
    ready_dir = tempfile.mkdtemp(prefix="keras-mirror-ready-")
    workers = []
    started = time.monotonic()
    try:
        for index in tasks:
            ready_file = os.path.join(ready_dir, f"worker-{index}.ready")
            worker_env = _worker_env(env, addresses, index, attempt, ready_file)
            try:
                workers.append(_Worker(index, command, worker_env, ready_file))
            except OSError as e:
                _say(
                    f"cannot start worker {index}: {e}. Received: "
                    f"command={list(command)!r}"
                )
                return 127, False, None
        return _supervise(workers, addresses, deadline, start_timeout,
                          started, grace_period)
    finally:
        with _signals_ignored():
            _stop(workers, grace_period)
        shutil.rmtree(ready_dir, ignore_errors=True)


@contextlib.contextmanager
def _signals_ignored():
    """Ignores SIGINT, SIGTERM and SIGHUP, so that stopping completes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, signal.SIG_IGN)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Terminated(BaseException):
    """Raised in the launcher's main thread on SIGTERM or SIGHUP."""


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


_FLAGS = {
    "command": "command",
    "num_workers": "--nproc-per-node",
    "max_restarts": "--max-restarts",
    "min_workers": "--min-workers",
    "cpus_per_worker": "--cpus-per-worker",
    "timeout": "--timeout",
    "start_timeout": "--start-timeout",
    "grace_period": "--grace-period",
}


def _shown(name, value, flags):
    if flags:
        return f"`{_FLAGS[name]}`", f"{_FLAGS[name]} {value}"
    return f"`{name}`", f"{name}={value!r}"


def _check_count(name, value, minimum, flags=False, optional=False):
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what, received = _shown(name, value, flags)
        raise ValueError(
            f"{what} must be an integer >= {minimum}. "
            f"Received: {received}"
        )


def _check_seconds(name, value, optional, flags=False):
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (value > 0 if optional else value >= 0):
        kind = "positive, or None for no limit" if optional else ">= 0"
        if flags:
            kind = "positive" if optional else ">= 0"
        what, received = _shown(name, value, flags)
        raise ValueError(
            f"{what} must be a number of seconds, {kind}. "
            f"Received: {received}"
        )


def _check_args(command, num_workers, max_restarts, timeout, start_timeout,
                grace_period, min_workers=None, cpus_per_worker=None,
                flags=False):
    """Checks the arguments; messages name the flags when `flags`."""
    if (
        isinstance(command, str)
        or not command
        or not all(isinstance(word, str) for word in command)
    ):
        raise ValueError(
            "`command` must be a non-empty list of strings, such as "
            f"['python', 'train.py']. Received: command={command!r}"
        )
    _check_count("num_workers", num_workers, 1, flags)
    _check_count("max_restarts", max_restarts, 0, flags)
    _check_count("min_workers", min_workers, 1, flags, optional=True)
    _check_count("cpus_per_worker", cpus_per_worker, 1, flags, optional=True)
    if min_workers is not None and min_workers > num_workers:
        what, received = _shown("min_workers", min_workers, flags)
        other = _shown("num_workers", num_workers, flags)
        raise ValueError(
            f"{what} must be at most {other[0]} ({num_workers}). "
            f"Received: {received}"
        )
    _check_seconds("timeout", timeout, True, flags)
    if not (flags and start_timeout == 0):
        _check_seconds("start_timeout", start_timeout, True, flags)
    _check_seconds("grace_period", grace_period, False, flags)


def resolve_command(command):
    """The worker command, with `python` meaning this interpreter.

    As in `torchrun`: a first word `python` or `python3` becomes
    `sys.executable` (so that workers run in the launcher's environment,
    an unactivated virtualenv included), and a first word ending in `.py`
    is run by it.
    """
    command = list(command)
    if command and command[0] in ("python", "python3"):
        return [sys.executable] + command[1:]
    if command and command[0].endswith(".py"):
        return [sys.executable] + command
    return command


def _next_size(size, failed, last_failed, min_workers):
    """The group size after a failure: one fewer when a worker keeps failing.

    A worker keeps failing when the same worker index failed in two
    attempts in a row; the group then shrinks by one (never below
    `min_workers`), dropping the last index.
    """
    if min_workers is None or failed is None or failed != last_failed:
        return size
    return max(min_workers, size - 1)


def launch(
    command,
    num_workers,
    max_restarts=0,
    timeout=None,
    start_timeout=DEFAULT_START_TIMEOUT,
    env=None,
    grace_period=DEFAULT_GRACE_PERIOD,
    min_workers=None,
    cpus_per_worker=None,
):
    """Runs `command` as `num_workers` local workers and supervises them.

    See the module docstring for the environment each worker gets, the
    readiness protocol, and how failures, restarts, preemptions and
    timeouts behave. Worker output is copied, prefixed, to `sys.stdout` /
    `sys.stderr`. In the main thread, SIGTERM, SIGHUP and Ctrl-C stop every
    worker before `launch` returns `128 + signal`; if the launcher is
    killed outright (SIGKILL), Linux kills its workers
    (`PR_SET_PDEATHSIG`).

    Args:
        command: list of str. The program and its arguments, e.g.
            `["python", "train.py"]` (`python` means `sys.executable`).
        num_workers: int. Number of local workers, at least 1.
        max_restarts: int. How many times to restart the whole group after
            a failure; default 0. Preemptions do not count.
        timeout: float or `None`. Seconds for the whole run, restarts
            included; default `None` (no limit).
        start_timeout: float or `None`. Seconds each attempt's workers have
            to become ready (build their strategy, or exit); default 300.
            `None` turns the check off.
        env: mapping or `None`. The environment the workers start from;
            default `os.environ`. `TF_CONFIG` and the `KERAS_MIRROR_*`
            variables are set on top of it.
        grace_period: float. Seconds between SIGTERM and SIGKILL when the
            launcher stops workers; default 5.
        min_workers: int or `None`. Elastic restarts: when the same worker
            fails in two attempts in a row, the next attempt runs one
            worker fewer, down to `min_workers`; after a preemption the
            group grows back to `num_workers`. Default `None` (the group
            keeps its size). With a `StepBackup`, training resumes where
            it stopped and stays exact on any number of workers.
        cpus_per_worker: int or `None`. Logical CPU replicas per worker on
            hosts without GPUs (`KERAS_MIRROR_CPUS_PER_WORKER`); default
            `None` (the environment's value, else 1).

    Returns:
        0 if every worker exited with 0; else the first failing worker's
        exit status, `TIMEOUT_EXIT_CODE` (124), `START_TIMEOUT_EXIT_CODE`
        (125) or 127 when the command cannot be started.

    Raises:
        ValueError: if an argument is out of range; the message names it.

    Example:

    ```python
    from keras_mirror.launch import launch
    code = launch(["python", "train.py"], num_workers=2,
                  max_restarts=1, timeout=3600)
    ```
    """
    _check_args(command, num_workers, max_restarts, timeout, start_timeout,
                grace_period, min_workers, cpus_per_worker)
    command = resolve_command(command)
    if cpus_per_worker is not None:
        env = dict(os.environ if env is None else env)
        env[CPUS_ENV] = str(cpus_per_worker)
    deadline = None if timeout is None else time.monotonic() + timeout
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        return _attempts(command, num_workers, max_restarts, env, deadline,
                         start_timeout, grace_period, min_workers)
    except (KeyboardInterrupt, _Terminated) as e:
        signum = e.args[0] if e.args else signal.SIGINT
        _say(f"stopped by signal {signum}; all workers were stopped.")
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _attempts(command, num_workers, max_restarts, env, deadline,
              start_timeout, grace_period, min_workers):
    """Runs attempts until success, a final failure or the deadline."""
    size, failures, attempt, last_failed = num_workers, 0, 0, None
    preempted = 0
    while True:
        addresses = [f"127.0.0.1:{p}" for p in _free_ports(size)]
        _say(
            f"attempt {attempt + 1} of {max_restarts + preempted + 1}: "
            f"starting {size} worker(s) on {', '.join(addresses)}."
        )
        code, may_restart, failed = _run_attempt(
            command, addresses, range(size), attempt, env, deadline,
            start_timeout, grace_period)
        attempt += 1
        if code == PREEMPTED_EXIT_CODE:
            preempted += 1
            if size != num_workers:
                _say(f"growing back to {num_workers} worker(s) after the "
                     "preemption.")
            size, last_failed = num_workers, None
            _say("restarting all workers after the preemption (it does not "
                 "count against --max-restarts).")
            continue
        if code == 0 or not may_restart or failures == max_restarts:
            break
        failures += 1
        new_size = _next_size(size, failed, last_failed, min_workers)
        if new_size != size:
            _say(f"worker {failed} failed in two attempts in a row; "
                 f"continuing with {new_size} worker(s) (--min-workers "
                 f"{min_workers}).")
        size, last_failed = new_size, failed
        _say(f"restarting all workers ({max_restarts - failures + 1} "
             "restart(s) left).")
    if code:
        _say(f"giving up; exit code {code}.")
    return code


def add_arguments(parser):
    """Adds `keras-mirror launch`'s arguments to an argparse `parser`.

    For `keras_mirror.cli`, which makes `launch` a subcommand; `run(args,
    parser)` then runs it.
    """
    parser.add_argument(
        "-n", "--nproc-per-node", "--num-workers", dest="num_workers",
        type=int, required=True, metavar="N",
        help="number of local workers (torchrun's --nproc-per-node)")
    parser.add_argument(
        "--nnodes", default="1",
        help="number of hosts; the launcher starts workers on this host "
        "only, so it must be 1 (for several hosts see the README's "
        "Multi-worker section)")
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="K",
        help="restarts of the whole group after a failure (default 0; "
        "preemptions do not count)")
    parser.add_argument(
        "--min-workers", type=int, default=None, metavar="M",
        help="elastic: when the same worker fails twice in a row, restart "
        "with one worker fewer, down to M (default: keep the size)")
    parser.add_argument(
        "--cpus-per-worker", type=int, default=None, metavar="C",
        help="logical CPU replicas per worker on hosts without GPUs "
        "(default 1)")
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="seconds for the whole run (default: none)")
    parser.add_argument(
        "--start-timeout", type=float, default=DEFAULT_START_TIMEOUT,
        help="seconds for every worker to build its strategy "
        "(default %(default)g; 0 turns it off)")
    parser.add_argument(
        "--grace-period", type=float, default=DEFAULT_GRACE_PERIOD,
        help="seconds from SIGTERM to SIGKILL (default %(default)g)")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER,
        help="the worker command, after --")
    return parser


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras-mirror launch",
        description="Start N local workers of a training script with "
        "TF_CONFIG set, prefix their output, propagate exit codes, and "
        "restart or stop them on failure.",
        epilog="example: keras-mirror launch -n 2 -- python train.py "
        "--epochs 3",
    )
    return add_arguments(parser)


def run(args, parser, command=None):
    """Runs a parsed `keras-mirror launch` command line; returns the code."""
    command = args.command if command is None else command
    if not command:
        parser.error(
            "a worker command is required, e.g. "
            "`keras-mirror launch -n 2 -- python train.py`"
        )
    if args.nnodes not in ("1", "1:1"):
        parser.error(
            "`--nnodes` must be 1: keras-mirror launch starts workers on "
            "this host only; on several hosts, start the script on each "
            "with its TF_CONFIG (or under Slurm or Kubernetes). "
            f"Received: --nnodes {args.nnodes}")
    start_timeout = args.start_timeout or None
    try:
        _check_args(command, args.num_workers, args.max_restarts,
                    args.timeout, args.start_timeout, args.grace_period,
                    args.min_workers, args.cpus_per_worker, flags=True)
    except ValueError as e:
        parser.error(str(e))
    return launch(
        command,
        args.num_workers,
        max_restarts=args.max_restarts,
        timeout=args.timeout,
        start_timeout=start_timeout,
        grace_period=args.grace_period,
        min_workers=args.min_workers,
        cpus_per_worker=args.cpus_per_worker,
    )


def main(argv=None):
    """Entry point of `keras-mirror launch`; returns the exit code.

    Invalid arguments print a usage message and raise `SystemExit(2)`, as
    argparse does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "--" in argv:
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        command = args.command + argv[split + 1:]
    else:
        args = parser.parse_args(argv)
        command = args.command
    return run(args, parser, command)
