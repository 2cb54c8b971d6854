"""Runs a network benchmark's `--quick` mode for its smoke test.

`quick_report(script, out, timeout)` runs `benchmarks/<script>` with the
working tree's package, SIGKILLed after `timeout` seconds, and returns its
JSON report; where network namespaces cannot be made it checks that the
benchmark said why and exited 0, and skips the test with that reason.
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


def quick_report(script, out, timeout):
    reason = netns.unavailable()
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick",
         "--timeout", str(timeout - 8), "--out", str(out)], cwd=ROOT,
        capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if reason:
        assert "skipped" in proc.stdout and "root" in proc.stdout
        pytest.skip(f"cannot make network namespaces here: {reason}")
    return json.loads(out.with_suffix(".json").read_text())
