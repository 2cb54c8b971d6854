"""Saving: the `.keras` file loads in plain Keras without keras-mirror."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from support.helpers import data
from support.helpers import lean
from support.helpers import max_diff
from support.helpers import mlp

import keras_mirror

# Each test runs on both execution paths (conftest.py).
pytestmark = pytest.mark.usefixtures("execution")


def _trained(cpus, execution="auto"):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          execution=execution)
    mirrored.compile(optimizer="adam", loss="mse")
    x, y, _ = data(30)
    mirrored.fit(x, y, batch_size=7, epochs=2, verbose=0)
    return mirrored, x


_LOAD = textwrap.dedent("""
    import sys, json
    import numpy as np, keras
    results = {}
    for name in json.loads(sys.argv[1]):
        model = keras.saving.load_model(f"{name}.keras", safe_mode=True)
        got = model.predict(np.load(f"{name}_x.npy"), verbose=0)
        expected = np.load(f"{name}_expected.npy")
        results[name] = {"diff": float(np.abs(got - expected).max()),
                         "class": type(model).__name__}
    results["keras_mirror_imported"] = "keras_mirror" in sys.modules
    print(json.dumps(results))
""")


def test_saved_model_loads_in_a_process_without_keras_mirror(cpus, tmp_path):
    paths = ("strategy",)
    for path in paths:
        mirrored, x = _trained(cpus, execution=path)
        mirrored.save(tmp_path / f"{path}.keras")
        np.save(tmp_path / f"{path}_x.npy", x)
        np.save(tmp_path / f"{path}_expected.npy",
                mirrored.predict(x, verbose=0))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", lean(_LOAD),
                          json.dumps(paths)],
                         capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("keras_mirror_imported") is False
    assert set(result) == set(paths)
    for path in paths:
        assert result[path]["class"] == "Sequential", path
        assert result[path]["diff"] < 1e-6, path


def test_weights_round_trip(cpus, tmp_path):
    mirrored, x = _trained(cpus)
    path = tmp_path / "w.weights.h5"
    mirrored.save_weights(path)
    other = keras_mirror.MirroredModel(mlp(seed=7), devices=cpus[:2])
    other.load_weights(path)
    assert max_diff(other.get_weights(), mirrored.get_weights()) == 0.0
    np.testing.assert_allclose(other.predict(x, verbose=0),
                               mirrored.predict(x, verbose=0), atol=1e-6)


def test_model_checkpoint_writes_loadable_files(cpus, tmp_path):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(20)
    pattern = str(tmp_path / "ckpt_{epoch}.keras")
    mirrored.fit(x, y, batch_size=6, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(pattern)])
    assert sorted(os.listdir(tmp_path)) == ["ckpt_1.keras", "ckpt_2.keras"]
    loaded = keras.saving.load_model(tmp_path / "ckpt_2.keras")
    assert max_diff(loaded.get_weights(), mirrored.get_weights()) == 0.0
    weights = str(tmp_path / "best.weights.h5")
    mirrored.fit(x, y, batch_size=6, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(weights, save_weights_only=True)])
    assert os.path.exists(weights)


def test_model_property_is_a_plain_model_with_current_weights(cpus):
    original = mlp()
    mirrored, _ = _trained(cpus)
    assert mirrored.model is not original
    assert type(mirrored.model) is keras.Sequential
    assert max_diff(mirrored.model.get_weights(), mirrored.get_weights()) \
        == 0.0


def test_saved_file_resumes_training_like_the_wrapper(cpus, tmp_path):
    """Only the wrapper is compiled: the `.keras` file still carries the
    compile configuration and Adam's state, so plain Keras continues the
    run exactly where the wrapper does."""
    mirrored, x = _trained(cpus)
    _, y, _ = data(30)
    path = tmp_path / "m.keras"
    mirrored.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert loaded.compiled
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert int(loaded.optimizer.iterations.numpy()) == \
        int(mirrored.optimizer.iterations.numpy()) == 10
    kwargs = dict(batch_size=7, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, **kwargs)
    mirrored.fit(x, y, **kwargs)
    assert max_diff(loaded.get_weights(),
                    mirrored.model.get_weights()) < 1e-5


def test_saving_keeps_the_users_matching_optimizer(cpus, tmp_path):
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="mse")
    user_optimizer = model.optimizer
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    x, y, _ = data(30)
    mirrored.fit(x, y, batch_size=7, epochs=1, verbose=0)
    mirrored.save(tmp_path / "m.keras")
    assert model.optimizer is user_optimizer
    assert int(user_optimizer.iterations.numpy()) == 5
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.get_config()["momentum"] == 0.9
    np.testing.assert_allclose(loaded.optimizer.variables[-1].numpy(),
                               mirrored.optimizer.variables[-1].numpy())
