"""A launcher test worker that starts fast: it does not import TensorFlow.

Usage: `python toy_worker.py MODE [ARGS...]`, under `keras-mirror launch`.
Modes:

- `print`: prints its task index and cluster, one line to stderr; exits 0.
- `fail INDEX CODE`: worker INDEX exits with CODE after 0.5 s; the others
  sleep.
- `stubborn INDEX`: worker INDEX exits with 1 after 1 s; the others ignore
  SIGTERM and sleep.
- `fail-first`: worker 1 exits with 5 on attempt 0; every worker exits 0 on
  later attempts.
- `always-fail INDEX`: worker INDEX exits with 7 on every attempt; the
  others print `size N` (the number of workers) and exit 0 once the group
  no longer has an index INDEX, else sleep.
- `ready-only INDEX`: only worker INDEX marks itself ready; all sleep.
- `sleep`: marks itself ready and sleeps.
- `spawn`: marks itself ready, starts a helper process (`sleep 60`, as a
  data loader would), prints `helper pid=PID` and sleeps.

Sleeping workers print `sleeping pid=PID` first. Readiness follows the
protocol of `keras_mirror.launch.mark_ready` (create the file named by
`KERAS_MIRROR_READY_FILE`), written out here to keep TensorFlow out.
"""

import json
import os
import signal
import sys
import time


def _mark_ready():
    path = os.environ.get("KERAS_MIRROR_READY_FILE")
    if path:
        open(path, "w").close()


def _sleep():
    print(f"sleeping pid={os.getpid()}", flush=True)
    time.sleep(60)
    return 0


def _spawn():
    import subprocess

    helper = subprocess.Popen(["sleep", "60"])
    print(f"helper pid={helper.pid}", flush=True)
    _mark_ready()
    return _sleep()


def main(mode, *args):
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    attempt = int(os.environ["KERAS_MIRROR_RESTART"])
    if mode == "stubborn" and index != int(args[0]):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "spawn":
        return _spawn()
    if mode == "print":
        print(f"task index {index} of {config['cluster']['worker']}")
        print(f"hello from stderr {index}", file=sys.stderr)
        return 0
    if mode == "always-fail":
        size = len(config["cluster"]["worker"])
        if index == int(args[0]):
            time.sleep(0.3)
            return 7
        if size <= int(args[0]):
            print(f"size {size}")
            return 0
    if mode == "fail-first":
        print(f"attempt {attempt}")
        return 5 if attempt == 0 and index == 1 else 0
    if mode != "ready-only" or index == int(args[0]):
        _mark_ready()
    if mode == "fail" and index == int(args[0]):
        time.sleep(0.5)
        return int(args[1])
    if mode == "stubborn" and index == int(args[0]):
        time.sleep(1.0)
        return 1
    return _sleep()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
