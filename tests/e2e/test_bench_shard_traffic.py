"""Smoke test of `benchmarks/bench_shard_traffic.py --quick`.

Where network namespaces can be made (root, iproute2), runs the quick mode
(the working tree's package only, 2 workers in namespaces, 2 epochs of a
few TFRecords) and checks the report's shape: every record read once per
epoch and bytes on the link each step; never a timing, and no byte
bound (the full run's figures are in `docs/performance.md`). Elsewhere it
checks that the benchmark says why and exits 0, and skips with that
reason.
"""

import json
import os
import subprocess
import sys

import pytest
from support import helpers

ROOT = str(helpers.ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import netns  # noqa: E402

pytestmark = pytest.mark.xdist_group("network")  # see test_bench_network

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_shard_traffic.py")
TIMEOUT = 55


@pytest.mark.timeout(TIMEOUT + 5)
def test_quick_run_writes_report(tmp_path):
    reason = netns.unavailable()
    out = tmp_path / "traffic"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--timeout", "45", "--out",
         str(out)], cwd=ROOT, capture_output=True, text=True, env=env,
        timeout=TIMEOUT)  # SIGKILL on timeout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if reason:
        assert "skipped" in proc.stdout and "root" in proc.stdout
        pytest.skip(f"cannot make network namespaces here: {reason}")
    report = json.loads((tmp_path / "traffic.json").read_text())
    rows = report["rows"]
    assert [(r["label"], r["worker"]) for r in rows] == [
        ("after", 0), ("after", 1)]
    for r in rows:
        assert r["records_in_fit"] == r["share_2_epochs"] > 0
        assert r["rx_per_step"] > 0 and r["tx_per_step"] > 0
        assert r["gradient_bytes"] == 4 * r["params"]
        assert os.path.samefile(os.path.dirname(r["package"]), ROOT)
    assert "| after" in (tmp_path / "traffic.md").read_text()
