"""The demo, the project's main job, reaches its stated accuracy."""

import os
import subprocess
import sys


def test_demo_reaches_target_accuracy():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-m", "keras_mirror.cli", "demo"],
        capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "split plan for a global batch of 100: (25, 25, 25, 25)" \
        in out.stdout
    assert "split plan for the last batch of 37: (10, 9, 9, 9)" in out.stdout
    assert "reached the target 0.95" in out.stdout
    table = out.stdout.split("Per-replica summary")[1]
    rows = [line.split() for line in table.splitlines()
            if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows[:4]] == ["0", "1", "2", "3"]
    # 1437 images per epoch over 20 epochs, split (25,25,25,25) x14 and
    # (10,9,9,9) once per epoch.
    assert [int(r[2]) for r in rows[:4]] == [7200, 7180, 7180, 7180]
