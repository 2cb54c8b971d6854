"""Arguments: checks shared by `launch()` and the command line, argparse."""

import argparse
import sys

from keras_mirror.launch._supervise import DEFAULT_GRACE_PERIOD
from keras_mirror.launch._supervise import DEFAULT_START_TIMEOUT

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


def check_args(command, num_workers, max_restarts, timeout, start_timeout,
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


def parser():
    parser = argparse.ArgumentParser(
        prog="keras-mirror launch",
        description="Start N local workers of a training script with "
        "TF_CONFIG set, prefix their output, propagate exit codes, and "
        "restart or stop them on failure.",
        epilog="example: keras-mirror launch -n 2 -- python train.py "
        "--epochs 3",
    )
    return add_arguments(parser)
