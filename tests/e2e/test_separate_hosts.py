"""Two workers on two emulated hosts train like one device (issue 14).

Each worker runs in its own network namespace with its own address
(10.77.0.1 and 10.77.0.2, on veth links to a bridge in a third namespace,
shaped to 1 Gbit/s), as on two real hosts: the cluster in `TF_CONFIG`
names those addresses, not 127.0.0.1. `tests/support/workers/mw_train.py` (2
logical CPUs per worker, 4 replicas) trains on 45 rows with global batch
8, and both workers' final weights must equal single-device training
within 1e-5. Needs root and iproute2 (`benchmarks/netns.py`); skips with
the reason otherwise. Every process is bounded and SIGKILLed; the
namespaces are deleted in any case.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from support import helpers

ROOT = helpers.ROOT
sys.path.insert(0, str(ROOT / "benchmarks"))

import netns  # noqa: E402
from support.multi_worker import WORKER  # noqa: E402
from support.multi_worker import assert_equal_single_device  # noqa: E402

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("processes")

TIMEOUT = 110


def run_on_hosts(net, out, *args):
    hosts = [f"{a}:2222" for a in net.addresses]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(
                   [str(ROOT)] + os.environ.get("PYTHONPATH", "").split(
                       os.pathsep)))
    procs, logs = [], []
    try:
        for i in range(net.n):
            tf_config = {"cluster": {"worker": hosts},
                         "task": {"type": "worker", "index": i}}
            log = open(out / f"worker_{i}.log", "w")
            logs.append(log)
            procs.append(net.popen(
                i, [sys.executable, str(WORKER), str(out), *args],
                env=dict(env, TF_CONFIG=json.dumps(tf_config)),
                stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        for p in procs:
            p.wait(timeout=TIMEOUT)
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()


@pytest.mark.timeout(TIMEOUT + 30)
def test_two_hosts_train_like_one_device(tmp_path):
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"cannot emulate separate hosts here: {reason}")
    with netns.Network(2, rate="1gbit") as net:
        codes = run_on_hosts(net, tmp_path, "--epochs", "2")
    logs = "".join((tmp_path / f"worker_{i}.log").read_text()[-3000:]
                   for i in range(2))
    assert codes == [0, 0], logs
    assert "2 workers x 2 replicas" in logs
    assert_equal_single_device(tmp_path)
    info = [json.loads((tmp_path / f"info_{i}.json").read_text())
            for i in (0, 1)]
    assert [i["local_replica_ids"] for i in info] == [[0, 1], [2, 3]]
