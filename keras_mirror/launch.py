"""`keras-mirror launch`: start N local workers of a script with `TF_CONFIG`.

```
keras-mirror launch -n 2 [--max-restarts K] [--timeout S]
    [--start-timeout S] [--grace-period S] -- python train.py args...
```

Starts `N` worker processes of the command on this host. Worker `i` gets:

- `TF_CONFIG={"cluster": {"worker": ["127.0.0.1:p0", ...]},
  "task": {"type": "worker", "index": i}}`, on ports that were free when
  the launcher picked them (by binding port 0);
- `KERAS_MIRROR_RESTART`: the attempt number, 0 at first, 1 after the
  first restart, and so on;
- `KERAS_MIRROR_READY_FILE`: a path of its own (see "Readiness" below);
- `PYTHONUNBUFFERED=1` unless set, so that output streams as it is printed.

Each line a worker prints is copied to the launcher's stdout (or stderr)
as `[worker i] line`; the launcher's own messages go to stderr as
`[launcher] ...`. A command whose first word ends in `.py` runs with the
launcher's own Python interpreter.

Failures. When any worker exits with a non-zero code, the launcher stops
the others: SIGTERM to each worker's process group, then SIGKILL after the
grace period (TensorFlow ignores SIGTERM while it waits in a collective).
If restarts remain, the whole group starts again on new ports; else the
launcher returns the first failing code (`128 + signal` for a worker
killed by a signal). A port taken by another process between the pick and
the worker's bind (a race no launcher can close) fails that worker with
TensorFlow's `Could not start gRPC server`; the launcher then names the
busy port, and a restart picks new ports.

Readiness. A worker is ready once it has created the file named by
`KERAS_MIRROR_READY_FILE`, which `mark_ready()` does. `MirroredModel`
calls it as soon as its strategy is built; building a
`MultiWorkerMirroredStrategy` waits until every peer has joined, so a
ready worker is one whose cluster is complete. Scripts that build their
own strategy call `keras_mirror.launch.mark_ready()` after it. A worker
that exits also counts as ready. If some worker is not ready within the
start-up timeout (a missing or unreachable peer makes TensorFlow wait
forever, silently), the launcher names the workers that were not ready,
stops the group and exits with `START_TIMEOUT_EXIT_CODE` (125), or
restarts if restarts remain. `--start-timeout 0` turns the check off, for
scripts that never call `mark_ready()`. `--timeout` bounds the whole run,
restarts included; when it expires the launcher stops every worker and
exits with `TIMEOUT_EXIT_CODE` (124), without restarting.

Separate hosts. The launcher only starts local workers. To run the same
script on several hosts, set `TF_CONFIG` by hand on each host, with the
same `"cluster"` everywhere and each host's own `"task"` index, and start
the script on every host (ports must be reachable between hosts):

```
# host 10.0.0.1
TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
            "task": {"type": "worker", "index": 0}}' python train.py
# host 10.0.0.2: the same, with "index": 1
```

`keras_mirror.cluster.cluster_from_env()` validates such a `TF_CONFIG`.
"""

import argparse
import contextlib
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

from keras_mirror import cluster as cluster_lib

READY_FILE_ENV = "KERAS_MIRROR_READY_FILE"
RESTART_ENV = "KERAS_MIRROR_RESTART"
TIMEOUT_EXIT_CODE = 124
START_TIMEOUT_EXIT_CODE = 125
DEFAULT_START_TIMEOUT = 300.0
DEFAULT_GRACE_PERIOD = 5.0
_POLL_SECONDS = 0.05
_PUMP_JOIN_SECONDS = 2.0
_OUTPUT_LOCK = threading.Lock()


def mark_ready():
    """Tells `keras-mirror launch` that this worker has started.

    Creates the file named by the `KERAS_MIRROR_READY_FILE` environment
    variable (atomically, with this process's id in it). Outside the
    launcher, where the variable is unset, it does nothing. `MirroredModel`
    calls it once its strategy is built; call it yourself after building a
    `MultiWorkerMirroredStrategy` in a script that does not use
    `MirroredModel`. Calling it again is harmless.

    Returns:
        `True` if a ready file was written, `False` if the variable is
        unset.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras_mirror.launch.mark_ready()
    ```
    """
    path = os.environ.get(READY_FILE_ENV)
    if not path:
        return False
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(temporary, path)
    return True


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


def _supervise(workers, addresses, deadline, start_timeout, started):
    """Waits for the group to succeed, fail or time out; returns a result.

    The result is `(exit_code, may_restart)`.
    """
    announced = False
    while True:
        codes = [w.process.poll() for w in workers]
        for worker, code in zip(workers, codes):
            if code:
                code = _exit_status(code)
                _say(_describe_failure(worker, addresses, code))
                return code, True
        if all(code == 0 for code in codes):
            return 0, False
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
                    "ready once it calls keras_mirror.launch.mark_ready() "
                    "(MirroredModel does when its strategy is built, which "
                    "waits for every peer); a missing or unreachable peer "
                    "keeps it waiting. Stopping all workers."
                )
                return START_TIMEOUT_EXIT_CODE, True
        if deadline is not None and time.monotonic() >= deadline:
            _say(
                "the run timed out (the `timeout` of the whole run "
                "expired); stopping all workers."
            )
            return TIMEOUT_EXIT_CODE, False
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

    Returns `(exit_code, may_restart)`. Every worker has exited, killed if
    need be, when it returns.
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
                return 127, False
        return _supervise(workers, addresses, deadline, start_timeout, started)
    finally:
        with _signals_ignored():
            _stop(workers, grace_period)
        shutil.rmtree(ready_dir, ignore_errors=True)


@contextlib.contextmanager
def _signals_ignored():
    """Ignores SIGINT and SIGTERM, so that stopping workers completes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, signal.SIG_IGN)
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Terminated(BaseException):
    """Raised in the launcher's main thread when it receives SIGTERM."""


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


def _check_count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. "
            f"Received: {name}={value!r}"
        )


def _check_seconds(name, value, optional):
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (value > 0 if optional else value >= 0):
        kind = "positive, or None for no limit" if optional else ">= 0"
        raise ValueError(
            f"`{name}` must be a number of seconds, {kind}. "
            f"Received: {name}={value!r}"
        )


def _check_args(
    command, num_workers, max_restarts, timeout, start_timeout, grace_period
):
    if (
        isinstance(command, str)
        or not command
        or not all(isinstance(word, str) for word in command)
    ):
        raise ValueError(
            "`command` must be a non-empty list of strings, such as "
            f"['python', 'train.py']. Received: command={command!r}"
        )
    _check_count("num_workers", num_workers, 1)
    _check_count("max_restarts", max_restarts, 0)
    _check_seconds("timeout", timeout, optional=True)
    _check_seconds("start_timeout", start_timeout, optional=True)
    _check_seconds("grace_period", grace_period, optional=False)


def launch(
    command,
    num_workers,
    max_restarts=0,
    timeout=None,
    start_timeout=DEFAULT_START_TIMEOUT,
    env=None,
    grace_period=DEFAULT_GRACE_PERIOD,
):
    """Runs `command` as `num_workers` local workers and supervises them.

    See the module docstring for the environment each worker gets, the
    readiness protocol, and how failures, restarts and timeouts behave.
    Worker output is copied, prefixed, to `sys.stdout` / `sys.stderr`. In
    the main thread, SIGTERM and Ctrl-C stop every worker before
    `launch` returns `128 + signal`.

    Args:
        command: list of str. The program and its arguments, e.g.
            `[sys.executable, "train.py"]`.
        num_workers: int. Number of local workers, at least 1.
        max_restarts: int. How many times to restart the whole group after
            a failure; default 0.
        timeout: float or `None`. Seconds for the whole run, restarts
            included; default `None` (no limit).
        start_timeout: float or `None`. Seconds each attempt's workers have
            to become ready (call `mark_ready()` or exit); default 300.
            `None` turns the check off.
        env: mapping or `None`. The environment the workers start from;
            default `os.environ`. `TF_CONFIG` and the `KERAS_MIRROR_*`
            variables are set on top of it.
        grace_period: float. Seconds between SIGTERM and SIGKILL when the
            launcher stops workers; default 5.

    Returns:
        0 if every worker exited with 0; else the first failing worker's
        exit status, `TIMEOUT_EXIT_CODE` (124), `START_TIMEOUT_EXIT_CODE`
        (125) or 127 when the command cannot be started.

    Raises:
        ValueError: if an argument is out of range; the message names it.

    Example:

    ```python
    import sys
    from keras_mirror.launch import launch
    code = launch([sys.executable, "train.py"], num_workers=2,
                  max_restarts=1, timeout=3600)
    ```
    """
    _check_args(
        command, num_workers, max_restarts, timeout, start_timeout, grace_period
    )
    command = list(command)
    deadline = None if timeout is None else time.monotonic() + timeout
    in_main = threading.current_thread() is threading.main_thread()
    previous = (
        signal.signal(signal.SIGTERM, _raise_terminated) if (in_main) else None
    )
    try:
        for attempt in range(max_restarts + 1):
            addresses = [f"127.0.0.1:{p}" for p in _free_ports(num_workers)]
            _say(
                f"attempt {attempt + 1} of {max_restarts + 1}: starting "
                f"{num_workers} worker(s) on {', '.join(addresses)}."
            )
            code, may_restart = _run_attempt(
                command,
                addresses,
                range(num_workers),
                attempt,
                env,
                deadline,
                start_timeout,
                grace_period,
            )
            if code == 0 or not may_restart or attempt == max_restarts:
                break
            _say(
                f"restarting all workers ({max_restarts - attempt} "
                "restart(s) left)."
            )
        if code:
            _say(f"giving up; exit code {code}.")
        return code
    except (KeyboardInterrupt, _Terminated) as e:
        signum = e.args[0] if e.args else signal.SIGINT
        _say(f"stopped by signal {signum}; all workers were stopped.")
        return 128 + signum
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras-mirror launch",
        description="Start N local workers of a training script with "
        "TF_CONFIG set, prefix their output, propagate exit codes, and "
        "restart or stop them on failure.",
        epilog="example: keras-mirror launch -n 2 -- python train.py "
        "--epochs 3",
    )
    parser.add_argument(
        "-n",
        "--num-workers",
        type=int,
        required=True,
        help="number of local workers",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts of the whole group after a failure (default 0)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds for the whole run (default: none)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT,
        help="seconds for every worker to call mark_ready() "
        "(default %(default)g; 0 turns it off)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        help="seconds from SIGTERM to SIGKILL (default %(default)g)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the worker command, after --"
    )
    return parser


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
        command = args.command + argv[split + 1 :]
    else:
        args = parser.parse_args(argv)
        command = args.command
    if not command:
        parser.error(
            "a worker command is required, e.g. "
            "`keras-mirror launch -n 2 -- python train.py`"
        )
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    start_timeout = args.start_timeout or None
    try:
        return launch(
            command,
            args.num_workers,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            start_timeout=start_timeout,
            grace_period=args.grace_period,
        )
    except ValueError as e:
        parser.error(str(e))
