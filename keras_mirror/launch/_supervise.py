"""Supervision: run a group of workers, wait, stop, restart or shrink it."""

import os
import shutil
import tempfile
import time

from keras_mirror.distribute import _multi_worker
from keras_mirror.launch import _ports
from keras_mirror.launch import _workers

PREEMPTED_EXIT_CODE = _multi_worker.PREEMPTED_EXIT_CODE


TIMEOUT_EXIT_CODE = 124
START_TIMEOUT_EXIT_CODE = 125
DEFAULT_START_TIMEOUT = 300.0
DEFAULT_GRACE_PERIOD = 5.0
_POLL_SECONDS = 0.05


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


def supervise(workers, addresses, deadline, start_timeout, started,
              grace_period=DEFAULT_GRACE_PERIOD):
    """Waits for the group to succeed, fail or time out; returns a result.

    The result is `(exit_code, may_restart, failed_worker_index)`.
    """
    announced = False
    while True:
        codes = [w.process.poll() for w in workers]
        for worker, code in zip(workers, codes):
            if code == PREEMPTED_EXIT_CODE:
                _workers.say(
                    f"worker {worker.index} was preempted (exit code "
                    f"{code}: it finished its step and the step backup "
                    "was written); waiting for the others to do the same.")
                _wait_preempted(workers, grace_period)
                return code, True, None
            if code:
                code = _workers.exit_status(code)
                _workers.say(_ports.describe_failure(worker, addresses, code))
                return code, True, worker.index
        if all(code == 0 for code in codes):
            return 0, False, None
        waiting = [w.index for w in workers if not w.update_ready()]
        if not waiting and not announced:
            announced = True
            _workers.say(
                f"all {len(workers)} worker(s) ready after "
                f"{time.monotonic() - started:.1f} s."
            )
        if waiting and start_timeout is not None:
            if time.monotonic() >= started + start_timeout:
                _workers.say(
                    f"worker(s) {_workers.names(waiting)} not ready within the "
                    f"start-up timeout of {start_timeout:g} s: a worker is "
                    "ready once it has built its multi-worker strategy "
                    "(`import keras_mirror` does, and so does "
                    "MirroredModel; it waits for every peer); a missing or "
                    "unreachable peer keeps it waiting. Stopping all "
                    "workers."
                )
                return START_TIMEOUT_EXIT_CODE, True, None
        if deadline is not None and time.monotonic() >= deadline:
            _workers.say(
                "the run timed out (`--timeout` of the whole run "
                "expired); stopping all workers."
            )
            return TIMEOUT_EXIT_CODE, False, None
        time.sleep(_POLL_SECONDS)


def run_attempt(
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
    guard = _workers.Guard(ready_dir)
    workers = []
    started = time.monotonic()
    try:
        for index in tasks:
            ready_file = os.path.join(ready_dir, f"worker-{index}.ready")
            worker_env = _ports.worker_env(env, addresses, index, attempt,
                                           ready_file)
            try:
                workers.append(_workers.Worker(index, command, worker_env,
                                               ready_file))
                guard.watch(workers[-1])
            except OSError as e:
                _workers.say(
                    f"cannot start worker {index}: {e}. Received: "
                    f"command={list(command)!r}"
                )
                return 127, False, None
        return supervise(workers, addresses, deadline, start_timeout,
                          started, grace_period)
    finally:
        with _workers.signals_ignored():
            _workers.stop(workers, grace_period)
            guard.close()
        shutil.rmtree(ready_dir, ignore_errors=True)


class Terminated(BaseException):
    """Raised in the launcher's main thread on SIGTERM or SIGHUP."""


def raise_terminated(signum, frame):
    raise Terminated(signum)


def next_size(size, failed, last_failed, min_workers):
    """The group size after a failure: one fewer when a worker keeps failing.

    A worker keeps failing when the same worker index failed in two
    attempts in a row; the group then shrinks by one (never below
    `min_workers`), dropping the last index.
    """
    if min_workers is None or failed is None or failed != last_failed:
        return size
    return max(min_workers, size - 1)


def attempts(command, num_workers, max_restarts, env, deadline,
             start_timeout, grace_period, min_workers):
    """Runs attempts until success, a final failure or the deadline."""
    size, failures, attempt, last_failed = num_workers, 0, 0, None
    preempted = 0
    while True:
        addresses = [f"127.0.0.1:{p}" for p in _ports.free_ports(size)]
        _workers.say(
            f"attempt {attempt + 1} of {max_restarts + preempted + 1}: "
            f"starting {size} worker(s) on {', '.join(addresses)}."
        )
        code, may_restart, failed = run_attempt(
            command, addresses, range(size), attempt, env, deadline,
            start_timeout, grace_period)
        attempt += 1
        if code == PREEMPTED_EXIT_CODE:
            preempted += 1
            if size != num_workers:
                _workers.say(f"growing back to {num_workers} worker(s) "
                             "after the preemption.")
            size, last_failed = num_workers, None
            _workers.say("restarting all workers after the preemption (it "
                         "does not count against --max-restarts).")
            continue
        if code == 0 or not may_restart or failures == max_restarts:
            break
        failures += 1
        new_size = next_size(size, failed, last_failed, min_workers)
        if new_size != size:
            _workers.say(
                f"worker {failed} failed in two attempts in a row; "
                f"continuing with {new_size} worker(s) (--min-workers "
                f"{min_workers}).")
        size, last_failed = new_size, failed
        _workers.say(f"restarting all workers "
                     f"({max_restarts - failures + 1} restart(s) left).")
    if code:
        _workers.say(f"giving up; exit code {code}.")
    return code
