"""Ports and readiness: each worker's address, `TF_CONFIG` and ready file.

The readiness signal itself (`READY_FILE_ENV`, `mark_ready`) belongs to
`keras_mirror.distribute._multi_worker`, which every worker imports.
"""

import json
import os
import socket

from keras_mirror.distribute import _multi_worker
from keras_mirror.distribute import cluster as cluster_lib

READY_FILE_ENV = _multi_worker.READY_FILE_ENV
CPUS_ENV = _multi_worker.CPUS_ENV
RESTART_ENV = "KERAS_MIRROR_RESTART"


def free_ports(n):
    """Returns `n` distinct TCP ports that are free on all interfaces now.

    The sockets are closed before the workers bind the ports, so another
    process may take one in between; `describe_failure` reports that.
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


def worker_env(base, addresses, index, attempt, ready_file):
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


def describe_failure(worker, addresses, code):
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
