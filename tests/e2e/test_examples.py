"""Each example runs end to end with short settings.

The four scripts run one after another in one fresh interpreter (one
TensorFlow start-up instead of four), each as `python examples/<name>.py
ARGS` would run it: `runpy` executes the file as `__main__` with its own
`sys.argv`, its stdout is captured and its exit code kept.
"""

import json
import os
import subprocess
import sys

import pytest
from support import helpers

EXAMPLES = helpers.EXAMPLES
TIMEOUT = 450
_RUN_EACH = """\
import contextlib, io, json, runpy, sys, traceback
results = {}
for name, argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = [name, *argv]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(name, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        except Exception:
            code = traceback.format_exc()
    results[name] = [code, out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """{script: its stdout}; asserts each script exited 0."""
    tmp = tmp_path_factory.mktemp("examples")
    runs = {
        "gan.py": ["--epochs", "1", "--steps", "3", "--logdir",
                   str(tmp / "runs"), "--out", str(tmp / "samples.png")],
        "classifier.py": ["--epochs", "2"],
        "custom_loss.py": ["--epochs", "1"],
        "contrastive.py": ["--epochs", "1"],
    }
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(  # SIGKILL on timeout
        [sys.executable, "-c", _RUN_EACH, json.dumps(
            [[str(EXAMPLES / s), argv] for s, argv in runs.items()])],
        capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    outs = {}
    for script in runs:
        code, stdout = results[str(EXAMPLES / script)]
        assert code == 0, (script, code, stdout[-3000:], done.stderr[-3000:])
        outs[script] = stdout
    return outs, tmp


@pytest.mark.timeout(TIMEOUT + 30)
def test_gan_example_writes_samples_and_replica_logs(outputs):
    outs, tmp = outputs
    stdout = outs["gan.py"]
    png, logdir = tmp / "samples.png", tmp / "runs"
    assert "final d_loss" in stdout
    per_replica = stdout.split("per-replica d_loss (last epoch):")[1]
    assert len(per_replica.splitlines()[0].split()) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import keras_mirror

    if hasattr(keras_mirror, "ReplicaTensorBoard"):
        runs = sorted(p.name for p in logdir.iterdir())
        assert runs[:4] == [f"replica_{i}" for i in range(4)]


@pytest.mark.timeout(TIMEOUT + 30)
def test_classifier_example(outputs):
    stdout = outputs[0]["classifier.py"]
    assert "split of the last batch: (14, 14, 14, 14)" in stdout
    accuracy = float(stdout.split("test accuracy")[1].split()[0])
    assert accuracy > 0.7


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("label", ["Loss subclass", "function"])
def test_custom_loss_example_is_exact(label, outputs):
    stdout = outputs[0]["custom_loss.py"]
    line = next(ln for ln in stdout.splitlines() if ln.startswith(label))
    assert float(line.rsplit(" ", 1)[1]) < 1e-5


@pytest.mark.timeout(TIMEOUT + 30)
def test_contrastive_example_is_exact_with_all_gather(outputs):
    stdout = outputs[0]["contrastive.py"]
    exact = stdout.split("max weight difference with all_gather:")[1]
    local = stdout.split("max weight difference, shard-local negatives:")[1]
    assert float(exact.split()[0]) < 1e-5
    assert float(local.split()[0]) > 1e-2
