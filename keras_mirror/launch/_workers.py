"""Worker processes: start one, copy its output, signal and stop a group."""

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_PUMP_JOIN_SECONDS = 2.0
_OUTPUT_LOCK = threading.Lock()


def say(message):
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


def exit_status(returncode):
    """A shell-style exit status: `128 + signal` for a killed process."""
    return 128 - returncode if returncode < 0 else returncode


class Worker:
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
    group, which `stop` signals as a whole. Elsewhere it does nothing.
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


# The guard: a tiny process outside the workers' groups that outlives a
# SIGKILLed launcher. It learns each worker's process group on its stdin;
# end of input without "done" means the launcher died: it SIGKILLs every
# group (the processes the workers started too, which PR_SET_PDEATHSIG
# does not reach) and removes the attempt's scratch folder.
_GUARD = """
import os, shutil, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
groups = []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


class Guard:
    """Kills the workers' process groups if the launcher dies outright."""

    def __init__(self, scratch):
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-c", _GUARD, scratch],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)

    def watch(self, worker):
        self._send(f"{worker.process.pid}\n")

    def close(self):
        """The launcher stopped its workers itself: the guard exits."""
        self._send("done\n")
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(_PUMP_JOIN_SECONDS * 5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _send(self, text):
        try:
            self.process.stdin.write(text.encode())
            self.process.stdin.flush()
        except (OSError, ValueError):
            pass


def stop(workers, grace_period):
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
        say(
            f"worker(s) {names(stubborn)} still running {grace_period:g} s "
            "after SIGTERM; sending SIGKILL."
        )
    for worker in workers:
        worker.signal(signal.SIGKILL)
    for worker in workers:
        try:
            worker.process.wait(_PUMP_JOIN_SECONDS * 5)
        except subprocess.TimeoutExpired:
            say(f"worker {worker.index} survived SIGKILL.")
    for worker in workers:
        for pump in worker.pumps:
            pump.join(_PUMP_JOIN_SECONDS)


def names(indices):
    return ", ".join(str(i) for i in indices)


@contextlib.contextmanager
def signals_ignored():
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
