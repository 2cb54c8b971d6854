"""Each example runs end to end with short settings (in its own process)."""

import os
import pathlib
import subprocess
import sys

import pytest
from test_launch import _clean_session  # noqa: F401

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(script, *args, cwd=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=180, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_gan_example_writes_samples_and_replica_logs(tmp_path):
    png = tmp_path / "samples.png"
    logdir = tmp_path / "runs"
    stdout = _run("gan.py", "--epochs", "1", "--steps", "3",
                  "--logdir", str(logdir), "--out", str(png))
    assert "final d_loss" in stdout
    per_replica = stdout.split("per-replica d_loss (last epoch):")[1]
    assert len(per_replica.splitlines()[0].split()) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import keras_mirror

    if hasattr(keras_mirror, "ReplicaTensorBoard"):
        runs = sorted(p.name for p in logdir.iterdir())
        assert runs[:4] == [f"replica_{i}" for i in range(4)]


def test_classifier_example():
    stdout = _run("classifier.py", "--epochs", "2")
    assert "split of the last batch: (14, 14, 14, 14)" in stdout
    accuracy = float(stdout.split("test accuracy")[1].split()[0])
    assert accuracy > 0.7


@pytest.mark.parametrize("label", ["Loss subclass", "function"])
def test_custom_loss_example_is_exact(label, request):
    stdout = request.getfixturevalue("_custom_loss_output")
    line = next(ln for ln in stdout.splitlines() if ln.startswith(label))
    assert float(line.rsplit(" ", 1)[1]) < 1e-5


@pytest.fixture(scope="module")
def _custom_loss_output():
    return _run("custom_loss.py", "--epochs", "1")


def test_contrastive_example_is_exact_with_all_gather():
    stdout = _run("contrastive.py", "--epochs", "1")
    exact = stdout.split("max weight difference with all_gather:")[1]
    local = stdout.split("max weight difference, shard-local negatives:")[1]
    assert float(exact.split()[0]) < 1e-5
    assert float(local.split()[0]) > 1e-2
