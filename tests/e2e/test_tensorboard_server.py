"""End to end: `ReplicaTensorBoard` runs as a real TensorBoard server sees them.

Trains a tiny model, starts `tensorboard` on a free 127.0.0.1 port, checks
its HTTP API lists every replica run and tag with the values `fit` logged,
then screenshots the scalars dashboard with headless Chromium (copied to
`test-artifacts/tensorboard.png`). Every wait is bounded; the server is
killed whatever happens.
"""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import keras
import numpy as np
import pytest
from support import helpers

import keras_mirror
from keras_mirror.callbacks import ReplicaTensorBoard

# Starts worker processes on ports (or namespaces): one xdist worker runs
# every such test, one after another (`--dist loadgroup`, setup.cfg).
pytestmark = pytest.mark.xdist_group("processes")

ROOT = str(helpers.ROOT)
ARTIFACT = os.path.join(ROOT, "test-artifacts", "tensorboard.png")
RUNS = ["replica_0", "replica_1", "replica_2", "replica_3", "train"]
REPLICA_TAGS = {
    p + k for p in ("batch_", "epoch_") for k in (
        "loss", "samples", "sample_weight", "grad_norm", "nonfinite",
        "step_time")
}
EPOCHS, STEPS = 3, 12
SERVER_TIMEOUT = 45
CHROMIUM_TIMEOUT = 40
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DASHBOARD = ("/#scalars&regexInput=replica&_smoothingWeight=0"
             "&tagFilter=batch_loss%7Cbatch_grad_norm")


def _train(log_dir):
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(STEPS * 20, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1)) + 0.3 * rng.normal(
        size=(STEPS * 20, 1))).astype("float32")
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    mirrored.fit(x, y, batch_size=20, epochs=EPOCHS, verbose=0,
                 callbacks=[ReplicaTensorBoard(log_dir, update_freq="batch")])
    return mirrored


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base, path, **query):
    url = base + path
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _start_server(log_dir, port):
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    cmd = [exe, "--logdir", str(log_dir), "--host", "127.0.0.1",
           "--port", str(port), "--load_fast", "false",
           "--reload_interval", "1"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    # A session of its own, so that the kill below reaches any child too.
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env,
                            start_new_session=True)


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _wait_for_runs(proc, base):
    """Polls `/data/runs` until every run is loaded; fails on timeout."""
    deadline = time.monotonic() + SERVER_TIMEOUT
    runs = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail("tensorboard exited with code "
                        f"{proc.returncode}: {proc.stderr.read()[-2000:]!r}")
        try:
            runs = _get(base, "/data/runs")
            tags = _get(base, "/data/plugin/scalars/tags")
            if runs == RUNS and all(
                    set(tags.get(r, ())) >= REPLICA_TAGS for r in RUNS[:4]):
                return runs, tags
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"tensorboard did not serve all runs within "
                f"{SERVER_TIMEOUT} s; last /data/runs: {runs!r}")


def _chromium():
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _screenshot(browser, url, png, profile):
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--hide-scrollbars",
        f"--user-data-dir={profile}", "--window-size=1400,1000",
        "--virtual-time-budget=15000", f"--screenshot={png}", url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=CHROMIUM_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.mark.timeout(150)
def test_tensorboard_server_shows_replica_runs(tmp_path):
    log_dir = tmp_path / "logs"
    mirrored = _train(log_dir)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(log_dir, port)
    try:
        runs, tags = _wait_for_runs(proc, base)
        assert set(tags["train"]) == {"batch_loss", "epoch_loss"}
        for r, run in enumerate(RUNS[:4]):
            assert set(tags[run]) == REPLICA_TAGS
            points = _get(base, "/data/plugin/scalars/scalars",
                          run=run, tag="batch_loss")
            assert [p[1] for p in points] == list(range(1, EPOCHS * STEPS
                                                        + 1))
            logged = [s["loss"][r] for s in mirrored.replica_history["batch"]]
            assert [p[2] for p in points] == pytest.approx(logged, rel=1e-6)
            epochs = _get(base, "/data/plugin/scalars/scalars",
                          run=run, tag="epoch_samples")
            assert [(p[1], p[2]) for p in epochs] == [
                (e, 5.0 * STEPS) for e in range(EPOCHS)]

        browser = _chromium()
        if browser is None:
            pytest.skip("no Chromium binary (tried "
                        f"{', '.join(CHROMIUM_NAMES)}): screenshot skipped; "
                        "install it with `apt-get install -y chromium`")
        png = tmp_path / "tensorboard.png"
        _screenshot(browser, base + DASHBOARD, png, tmp_path / "chromium")
    finally:
        _kill(proc)
    assert _png_size(png) == (1400, 1000)
    assert png.stat().st_size > 20_000  # a blank page is a few kB
    os.makedirs(os.path.dirname(ARTIFACT), exist_ok=True)
    shutil.copyfile(png, ARTIFACT)
