"""Smoke test of `benchmarks/bench_bn_network.py --quick`.

Where network namespaces can be made (root, iproute2), runs the quick mode
(one link, one round of 2 steps of each variant, 2 workers in namespaces)
and checks the report's shape, and that global BatchNorm's weights are
closer to one device's than per-replica BatchNorm's; never a timing.
Elsewhere it checks that the benchmark says why and exits 0, and skips
with that reason.
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

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_bn_network.py")
TIMEOUT = 58


@pytest.mark.timeout(TIMEOUT + 2)
def test_quick_run_writes_report(tmp_path):
    reason = netns.unavailable()
    out = tmp_path / "bn"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--timeout", "50", "--out",
         str(out)], cwd=ROOT, capture_output=True, text=True, env=env,
        timeout=TIMEOUT)  # SIGKILL on timeout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if reason:
        assert "skipped" in proc.stdout and "root" in proc.stdout
        pytest.skip(f"cannot make network namespaces here: {reason}")
    report = json.loads((tmp_path / "bn.json").read_text())
    (row,) = report["rows"]
    assert row["rate"] == "1gbit"
    for v in ("global", "per_replica", "no_bn"):
        assert row[f"{v}_ms"] > 0 and row[f"{v}_rx"] > 0, v
    assert row["exact_global"] < row["exact_per_replica"]
    assert "| 1gbit" in (tmp_path / "bn.md").read_text()
