"""The demo, the project's main job, reaches its stated accuracy."""

import os
import subprocess
import sys

from test_launch import _clean_session  # noqa: F401

from keras_mirror import demo


def test_demo_reaches_target_accuracy():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "keras_mirror.cli", "demo"],
        capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # TensorFlow's start-up lines (oneDNN, CUDA stubs, cuInit) are hidden.
    assert out.stderr == ""
    assert "split plan for a global batch of 100: (25, 25, 25, 25)" \
        in out.stdout
    assert "split plan for the last batch of 37: (10, 9, 9, 9)" in out.stdout
    assert "reached the target 0.95" in out.stdout
    assert out.stdout.count("tracing the training step") == 1
    table = out.stdout.split(demo.REPLICA_TITLE)[1]
    lines = table.splitlines()
    header = [line for line in lines if line.startswith("┃")]
    assert [c.strip() for c in header[0].strip("┃").split("┃")] == \
        demo.REPLICA_HEADER
    rows = [[c.strip() for c in line.strip("│").split("│")]
            for line in lines if line.startswith("│")]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[1] for r in rows] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    # 1437 images per epoch over 20 epochs, split (25,25,25,25) x14 and
    # (10,9,9,9) once per epoch.
    assert [int(r[2]) for r in rows] == [7200, 7180, 7180, 7180]
    assert [r[5] for r in rows] == ["0"] * 4
