"""Smoke test of `benchmarks/bench_step.py` in `--quick` mode.

Runs the harness in a subprocess on a tiny configuration and checks the JSON
report's shape and that its numbers are positive. No timing assertions: the
machine is shared and the numbers are noise at this size.
"""

import json
import os
import subprocess
import sys

import pytest
from support import helpers

ROOT = str(helpers.ROOT)
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_step.py")
# Each quick run starts fresh trial processes; under `-n 2` the other xdist
# worker shares the cores (55 s timed out at load average 7, 2 cores).
TIMEOUT = 150

RESULT_KEYS = {
    "median_step_ms",
    "min_trial_step_ms",
    "max_trial_step_ms",
    "first_step_s",
    "setup_s",
    "peak_rss_mb",
    "rss_after_import_mb",
}


@pytest.mark.timeout(TIMEOUT + 5)
def test_quick_run_writes_report(tmp_path):
    out = tmp_path / "quick"
    cmd = [
        sys.executable, SCRIPT, "--quick", "--models", "mlp",
        "--replicas", "2", "--variants", "native,mirrored", "--steps", "2",
        "--out", str(out),
    ]
    proc = subprocess.run(  # SIGKILL on timeout
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "quick.json").read_text())
    assert (tmp_path / "quick.md").read_text().startswith("# bench_step")

    assert {
        "machine", "settings", "results", "ratios", "notes", "trials",
    } <= set(report)
    for key in ("cpu_model", "logical_cores", "tensorflow", "keras"):
        assert report["machine"][key]
    assert report["settings"]["steps"] == 2

    rows = {(r["variant"], r["replicas"]): r for r in report["results"]}
    expected = {("native", 2)}
    if "mirrored" in report["settings"]["variants"]:
        expected.add(("mirrored", 2))
    else:
        assert any("MirroredModel skipped" in n for n in report["notes"])
    assert set(rows) == expected
    for row in rows.values():
        assert row["trials_ok"] == 1 and row["trials_failed"] == 0
        assert RESULT_KEYS <= set(row)
        for key in RESULT_KEYS:
            assert row[key] > 0, (key, row)

    (ratio,) = report["ratios"]
    assert ratio["model"] == "mlp" and ratio["replicas"] == 2
    assert ratio["native_over_single"] is None  # single was not run
    if ("mirrored", 2) in rows:
        assert ratio["mirrored_over_native"] > 0
    else:
        assert ratio["mirrored_over_native"] is None


OVERHEAD = os.path.join(ROOT, "benchmarks", "bench_overhead.py")


@pytest.mark.timeout(TIMEOUT + 5)
def test_overhead_quick_run_writes_report(tmp_path):
    out = tmp_path / "overhead"
    cmd = [sys.executable, OVERHEAD, "--quick", "--models", "mlp",
           "--out", str(out)]
    proc = subprocess.run(  # SIGKILL on timeout
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "overhead.json").read_text())
    assert (tmp_path / "overhead.md").read_text().startswith(
        "# bench_overhead")
    (row,) = report["results"]
    assert row["model"] == "mlp" and row["execution"] == "strategy"
    assert len(report["trials"]) == 2
    for trial in report["trials"]:
        assert min(trial["single_ms"], trial["mirrored_ms"],
                   trial["nostats_ms"]) > 0
        assert trial["ratio"] == pytest.approx(
            trial["mirrored_ms"] / trial["single_ms"])
        assert trial["nostats_ratio"] == pytest.approx(
            trial["nostats_ms"] / trial["single_ms"])
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    assert row["nostats_ratio_min"] <= row["nostats_ratio_median"] \
        <= row["nostats_ratio_max"]


@pytest.mark.timeout(TIMEOUT + 5)
def test_input_walk_follows_x_to_the_first_step():
    """`benchmarks/input_walk.py` names the modules `x` passes through,
    the wrapper's entry first, and counts them."""
    script = os.path.join(ROOT, "benchmarks", "input_walk.py")
    done = subprocess.run([sys.executable, script], capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    path, summary = done.stdout.strip().splitlines()[-2:]
    modules = path.split(" -> ")
    assert modules[:2] == ["mirrored_model.py", "wrapper/_fit_input.py"]
    counts = summary.split(": ")[1].split(", ")
    assert int(counts[0].split()[0]) == len(set(modules))
    assert int(counts[1].split()[0]) == len(modules) - len(set(modules))
