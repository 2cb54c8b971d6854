"""Smoke test of `benchmarks/bench_network.py --quick` on a small plan.

Where network namespaces can be made (root, iproute2), runs the harness in
a subprocess on one model and one link with the variants its ratio line
needs, and checks the report's shape and the last line's format; never a
timing. Elsewhere it checks that the benchmark says why and exits 0, and
skips with that reason.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from support import helpers

ROOT = str(helpers.ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import netns  # noqa: E402

# Starts worker processes in network namespaces: one xdist worker runs the
# "network" group (this and the virtual-shard runs) one test after another
# (`--dist loadgroup`, setup.cfg), beside the "workers" and "processes"
# groups, so that three process chains of similar length run side by side.
pytestmark = pytest.mark.xdist_group("network")

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_network.py")
TIMEOUT = 240
LAST_LINE = re.compile(
    r"^comm_bf16/comm_fp32=[0-9.]+ overlap_step/max\(compute,comm\)="
    r"[0-9.]+ mirror/native=[0-9.]+$")


def test_netns_rejects_a_bad_rate():
    with pytest.raises(ValueError, match="Received: rate="):
        netns.Network(2, rate="fast")


@pytest.mark.timeout(TIMEOUT + 10)
def test_quick_run_writes_report(tmp_path):
    reason = netns.unavailable()
    out = tmp_path / "net"
    cmd = [sys.executable, SCRIPT, "--quick", "--models", "mlp",
           "--rates", "1gbit", "--steps", "2", "--variants",
           "comm_fp32,comm_bf16,native,mirror,mirror_bucket",
           "--timeout", "200", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT)  # SIGKILL on timeout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if reason:
        assert "skipped" in proc.stdout and "root" in proc.stdout
        pytest.skip(f"cannot make network namespaces here: {reason}")
    lines = proc.stdout.strip().splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-5:]
    report = json.loads((tmp_path / "net.json").read_text())
    (row,) = report["rows"]
    assert (row["model"], row["rate"], row["workers"]) == ("mlp", "1gbit", 2)
    for key in ("single", "compute", "ring_model", "comm_fp32", "comm_bf16",
                "native", "mirror", "mirror_bucket"):
        assert row[key] > 0, key
    assert row["bytes_fp32"] == 4 * row["params"]
    assert report["machine"]["logical_cores"] >= 1
    assert "| mlp" in (tmp_path / "net.md").read_text()
