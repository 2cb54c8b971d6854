"""Ends a multi-worker test worker as soon as every worker is done.

Measured on TF 2.21: a worker whose peers have already exited waits for
their coordination-service heartbeats to fail (7-14 s on this machine)
before it exits, so every launch of `mw_train.py` or `vs_train.py` ended
that much after its last step. Instead, each worker writes
`OUT_DIR/finished_<task index>` once its own results are written, waits
(bounded) until every worker of the group has written its file, so that no
worker still waits on a collective, and leaves with `os._exit(0)`, without
TensorFlow's shutdown. Past the bound it returns and the worker exits as
usual.
"""

import os
import pathlib
import sys
import time


def exit_together(out_dir, index, num_workers, timeout=30):
    """Exits with 0 once `num_workers` workers finished; else returns."""
    out = pathlib.Path(out_dir)
    (out / f"finished_{index}").touch()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((out / f"finished_{i}").exists() for i in range(num_workers)):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        time.sleep(0.05)
