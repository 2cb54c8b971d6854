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
- `KERAS_MIRROR_VIRTUAL_SHARDS`: `--nproc-per-node` unless set, the
  default `virtual_shards` of `worker_input="shard"`; an elastic restart
  on fewer workers keeps it, so the global batches stay the same;
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
The launcher waits for the others to exit, then restarts the group at its
full size; this does not count against `--max-restarts`.

Elastic. With `--min-workers M`, when the same worker index fails in two
attempts in a row, the next attempt runs one worker fewer (down to M);
with a `StepBackup` the run resumes where it stopped, and stays exact on
any number of workers (a step does not depend on the replica count).

The launcher's death. SIGTERM, SIGHUP and Ctrl-C stop every worker before
the launcher exits with `128 + signal`. A launcher killed outright
(SIGKILL) cannot clean up: each worker asks Linux for SIGKILL when its
parent dies (`PR_SET_PDEATHSIG`), and a small guard process per attempt,
outside the workers' process groups, sees the launcher's end (its stdin
closes) and SIGKILLs every worker's process group, with the processes the
workers started (a data loader's helpers, `subprocess.Popen`), then
removes the attempt's `keras-mirror-ready-*` folder. A process that left
its worker's group (`setsid`) is out of reach.

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

import os
import signal
import sys
import threading
import time

from keras_mirror.distribute import _multi_worker
from keras_mirror.launch import _arguments
from keras_mirror.launch import _supervise
from keras_mirror.launch import _workers
from keras_mirror.launch._arguments import add_arguments as add_arguments
from keras_mirror.launch._arguments import resolve_command as resolve_command
from keras_mirror.launch._ports import CPUS_ENV as CPUS_ENV
from keras_mirror.launch._ports import READY_FILE_ENV as READY_FILE_ENV
from keras_mirror.launch._ports import RESTART_ENV as RESTART_ENV
from keras_mirror.launch._supervise import (
    DEFAULT_GRACE_PERIOD as DEFAULT_GRACE_PERIOD,
)
from keras_mirror.launch._supervise import (
    DEFAULT_START_TIMEOUT as DEFAULT_START_TIMEOUT,
)
from keras_mirror.launch._supervise import (
    PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE,
)
from keras_mirror.launch._supervise import (
    START_TIMEOUT_EXIT_CODE as START_TIMEOUT_EXIT_CODE,
)
from keras_mirror.launch._supervise import (
    TIMEOUT_EXIT_CODE as TIMEOUT_EXIT_CODE,
)


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
    _arguments.check_args(command, num_workers, max_restarts, timeout,
                          start_timeout, grace_period, min_workers,
                          cpus_per_worker)
    command = resolve_command(command)
    env = dict(os.environ if env is None else env)
    if cpus_per_worker is not None:
        env[CPUS_ENV] = str(cpus_per_worker)
    env.setdefault(_multi_worker.VIRTUAL_SHARDS_ENV, str(num_workers))
    deadline = None if timeout is None else time.monotonic() + timeout
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum,
                                             _supervise.raise_terminated)
    try:
        return _supervise.attempts(command, num_workers, max_restarts, env,
                                   deadline, start_timeout, grace_period,
                                   min_workers)
    except (KeyboardInterrupt, _supervise.Terminated) as e:
        signum = e.args[0] if e.args else signal.SIGINT
        _workers.say(f"stopped by signal {signum}; all workers were stopped.")
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
        _arguments.check_args(command, args.num_workers, args.max_restarts,
                              args.timeout, args.start_timeout,
                              args.grace_period, args.min_workers,
                              args.cpus_per_worker, flags=True)
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
    parser = _arguments.parser()
    if "--" in argv:
        split = argv.index("--")
        args = parser.parse_args(argv[:split])
        command = args.command + argv[split + 1:]
    else:
        args = parser.parse_args(argv)
        command = args.command
    return run(args, parser, command)
