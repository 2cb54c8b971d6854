"""A user's plain script (build, wrap, fit) on several workers.

`tests/support/workers/plain_train.py` has no keras-mirror line besides
`MirroredModel`; under `keras-mirror launch` it must train to the
single-device weights. When TensorFlow initialised its devices before
`import keras_mirror`, the error names the line to move.
"""

import functools
import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from support import helpers
from support.multi_worker import no_leftover_processes  # noqa: F401

from keras_mirror import launch as launch_lib
from keras_mirror.launch import _ports

# Starts worker processes on ports: one xdist worker runs the "workers"
# group (multi-worker training runs) one test after another (`--dist
# loadgroup`, setup.cfg), beside the "network" and "processes" groups.
pytestmark = pytest.mark.xdist_group("workers")

WORKERS = helpers.WORKERS


@functools.cache
def single_device_weights(epochs=2):
    """Plain Keras on one device, computed once: the reference weights."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(45, 6)).astype("float32")
    y = rng.normal(size=(45, 3)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


@pytest.mark.timeout(120)
def test_plain_script_under_launcher_trains_like_one_device(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    # "python" means the launcher's own interpreter, as in torchrun.
    code = launch_lib.main([
        "--nproc-per-node", "2", "--cpus-per-worker", "2", "--timeout",
        "100", "--start-timeout", "60", "--grace-period", "2", "--",
        "python", str(WORKERS / "plain_train.py"), str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "[launcher] all 2 worker(s) ready" in err
    assert "multi-worker: 2 workers x 2 replicas" in err
    files = sorted(tmp_path.glob("weights_*.npz"))
    assert len(files) == 2
    ref = single_device_weights()
    for path in files:
        with np.load(path) as f:
            assert int(f["workers"]) == 2 and int(f["replicas"]) == 4
            weights = [f[f"arr_{i}"] for i in range(len(ref))]
        assert max_diff(weights, ref) < 1e-5


LATE = """\
import tensorflow as tf
tf.constant(1.0)

import keras_mirror
"""


@pytest.mark.timeout(60)
def test_tensorflow_initialised_first_names_the_line_to_move(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(LATE)
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
              "task": {"type": "worker", "index": 0}}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True,
        timeout=50, env={**dict(__import__("os").environ),
                         "TF_CONFIG": json.dumps(config),
                         "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "keras_mirror.errors.DevicesAlreadyInitializedError: keras-mirror "
        "sets up this worker's multi-worker strategy when it is imported, "
        "before TensorFlow initialises its devices; they were already "
        "initialised. Move `import keras_mirror` (late.py, line 4: `import "
        "keras_mirror`) above the first line that builds a model or runs "
        "TensorFlow (a tensor, a layer, `tf.config.list_logical_devices`). "
        "Received: a cluster of 2 workers from the environment")


def _two_free_ports():
    from keras_mirror import cluster

    for _ in range(50):
        port = _ports.free_ports(1)[0]
        if port < 65535 and not cluster.port_in_use(port + 1):
            return port
    pytest.skip("no two consecutive free ports")


def _run_tasks(tmp_path, envs):
    """Runs plain_train.py once per environment, as a cluster would."""
    logs = [open(tmp_path / f"task{i}.log", "w") for i in range(len(envs))]
    tasks = [subprocess.Popen(
        [sys.executable, str(WORKERS / "plain_train.py"), str(tmp_path)],
        env=env, stdout=log, stderr=subprocess.STDOUT)
        for env, log in zip(envs, logs)]
    try:
        codes = [task.wait(100) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
            task.wait()
        for log in logs:
            log.close()
    text = "".join((tmp_path / f"task{i}.log").read_text()
                   for i in range(len(envs)))
    assert codes == [0] * len(envs), text[-3000:]
    ref = single_device_weights()
    files = sorted(tmp_path.glob("weights_*.npz"))
    assert len(files) == len(envs)
    for path in files:
        with np.load(path) as f:
            weights = [f[f"arr_{i}"] for i in range(len(ref))]
        assert max_diff(weights, ref) < 1e-5
    return text


def _base_env():
    import os

    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM") and k != "TF_CONFIG"}
    env.update(KERAS_MIRROR_CPUS_PER_WORKER="2", TF_CPP_MIN_LOG_LEVEL="3",
               PATH="/usr/bin:/bin")  # no nvidia-smi
    return env


@pytest.mark.timeout(120)
def test_plain_script_under_srun_environment_trains_like_one_device(
        tmp_path):
    # What `srun -N 1 -n 2 python plain_train.py` sets on a CPU-only node:
    # task i listens on KERAS_MIRROR_PORT_BASE + i.
    base = _base_env()
    base.update(
        SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_NTASKS="2",
        SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
        SLURM_JOB_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_NNODES="1", KERAS_MIRROR_PORT_BASE=str(_two_free_ports()))
    text = _run_tasks(tmp_path, [
        {**base, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}
        for i in (0, 1)])
    assert "multi-worker: 2 workers x 2 replicas" in text


@pytest.mark.timeout(120)
def test_plain_script_as_kubeflow_tfjob_chief_and_worker(tmp_path):
    # The TF_CONFIG a TFJob with one Chief and one Worker replica gives
    # each pod ("environment": "cloud" included): the chief is worker 0.
    ports = _ports.free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"],
               "worker": [f"127.0.0.1:{ports[1]}"]}
    text = _run_tasks(tmp_path, [
        {**_base_env(), "TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": kind, "index": 0},
             "environment": "cloud"})}
        for kind in ("chief", "worker")])
    assert "(this worker: task chief:0, replicas [0, 1], chief)" in text
    assert "(this worker: task worker:0, replicas [2, 3])." in text
