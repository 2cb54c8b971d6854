"""Safe files: what keras-mirror writes and what it agrees to load.

`MirroredModel.save` writes only `.keras` (and `save_weights` only
`.weights.h5`). `keras_mirror.load_model` loads only local `.keras` zip
archives, with `safe_mode=True`, after refusing configs that name code
outside Keras. Hostile fixtures are made by hand: a `Lambda` with Python
bytecode, and archives whose `config.json` names `os.system` (as a layer, as
an activation function, and through a non-modelling Keras API), each
written to touch a marker file if it ever ran.
"""

import ast
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import zipfile

import h5py
import keras
import numpy as np
import pytest
from keras.src.saving import serialization_lib
from support import helpers

import keras_mirror
from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror import saving

PACKAGE = pathlib.Path(keras_mirror.__file__).parent


def _model():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, activation="relu", name="dense")(inputs)
    return keras.Model(inputs, outputs)


def _saved(tmp_path, model=None, name="good.keras"):
    path = tmp_path / name
    (model or _model()).save(path)
    return path


def _rewrite_config(src, dst, edit):
    """Copies the `.keras` zip `src` to `dst` with `edit(config)` applied."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                edit(config)
                data = json.dumps(config).encode()
            zout.writestr(item, data)
    return dst


def _dense_config(config):
    return next(layer for layer in config["config"]["layers"]
                if layer["config"]["name"] == "dense")


def _os_system_layer(marker):
    def edit(config):
        layer = _dense_config(config)
        layer.update({"module": "os", "class_name": "system",
                      "registered_name": "system",
                      "config": f"touch {marker}"})
    return edit


def _os_system_activation(marker):
    def edit(config):
        _dense_config(config)["config"]["activation"] = {
            "module": "os", "class_name": "system",
            "config": f"touch {marker}", "registered_name": "system"}
    return edit


def _keras_non_modelling_api(marker):
    def edit(config):
        _dense_config(config)["config"]["activation"] = {
            "module": "keras.utils", "class_name": "get_file",
            "config": {"origin": f"file://{marker}"},
            "registered_name": None}
    return edit


@pytest.fixture
def safe_mode_state():
    before = serialization_lib.in_safe_mode()
    yield
    assert serialization_lib.in_safe_mode() == before


@pytest.fixture
def no_unsafe_switch(monkeypatch):
    def refuse():
        raise AssertionError("enable_unsafe_deserialization was called")

    monkeypatch.setattr(keras.config, "enable_unsafe_deserialization",
                        refuse)
    monkeypatch.setattr(serialization_lib, "enable_unsafe_deserialization",
                        refuse)


# -- hostile fixtures ----------------------------------------------------


def test_lambda_bytecode_is_refused(tmp_path, safe_mode_state,
                                    no_unsafe_switch):
    inputs = keras.Input((3,))
    outputs = keras.layers.Lambda(lambda t: t * 2.0)(inputs)
    path = _saved(tmp_path, keras.Model(inputs, outputs), "lambda.keras")
    with pytest.raises(errors.UnsafeModelError,
                       match=r"a Python lambda.*Received: filepath="):
        saving.load_model(path)
    # Keras's own loader in safe mode refuses it too (defence in depth).
    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(path, safe_mode=True)


@pytest.mark.parametrize("craft", [
    _os_system_layer, _os_system_activation])
def test_config_naming_os_system_is_refused(tmp_path, craft,
                                            safe_mode_state,
                                            no_unsafe_switch):
    marker = tmp_path / "pwned"
    path = _rewrite_config(_saved(tmp_path), tmp_path / "evil.keras",
                           craft(marker))
    with pytest.raises(errors.UnsafeModelError,
                       match=r"module 'os'.*Received: filepath="):
        saving.load_model(path)
    with pytest.raises(errors.UnsafeModelError):
        saving.load_model(path, devices=["/cpu:0"])
    assert not marker.exists()


def test_non_modelling_keras_api_is_refused(tmp_path, safe_mode_state):
    marker = tmp_path / "pwned"
    path = _rewrite_config(_saved(tmp_path), tmp_path / "evil.keras",
                           _keras_non_modelling_api(marker))
    with pytest.raises((ValueError, TypeError)):
        saving.load_model(path)
    assert not marker.exists()


def test_legacy_h5_full_model_is_refused(tmp_path, safe_mode_state):
    path = tmp_path / "legacy.h5"
    _model().save(path)  # Keras writes the legacy HDF5 format
    assert path.exists()
    with pytest.raises(errors.UnsafeModelError,
                       match=r"`filepath` must be a `.keras` file"):
        saving.load_model(path)
    disguised = tmp_path / "legacy.keras"
    disguised.write_bytes(path.read_bytes())
    with pytest.raises(errors.UnsafeModelError, match="not a zip file"):
        saving.load_model(disguised)


def test_archive_without_config_is_refused(tmp_path):
    path = tmp_path / "empty.keras"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("metadata.json", "{}")
    with pytest.raises(errors.UnsafeModelError, match="config.json"):
        saving.load_model(path)


def test_missing_and_remote_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="Received: filepath="):
        saving.load_model(tmp_path / "nope.keras")
    with pytest.raises(FileNotFoundError):
        saving.load_model("hf://someone/model.keras")
    with pytest.raises(errors.UnsafeModelError):
        saving.load_model(123)


# -- how much is read of each archive member ------------------------------

def _members(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def _archive(path, members, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _too_large(member, what, limit, knob, path):
    return re.escape(
        f"`filepath` holds the archive member '{member}', which {what} "
        f"bytes; keras-mirror reads at most {limit} bytes of it "
        f"(`keras_mirror.saving.{knob}`), so it refuses the file before "
        "Keras reads it. Raise that limit only for a file you trust. "
        f"Received: filepath='{path}'")


@pytest.fixture
def keras_never_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("keras.saving.load_model was called")

    monkeypatch.setattr(keras.saving, "load_model", refuse)


def test_default_member_limits():
    assert saving.MAX_JSON_BYTES == 64 * 2**20
    assert saving.MAX_MEMBER_BYTES == 64 * 2**30
    assert saving.MAX_JSON_VALUES == 2**20


def _dense_json(config, values):
    """`config` (bytes) with a list of `values` empty objects added."""
    head, _, _ = config.rpartition(b"}")
    return head + b', "pad": [' + b"{}," * (values - 1) + b"{}]}"


def _too_many(member, values, limit, path):
    return re.escape(
        f"`filepath` holds the archive member '{member}', which holds up "
        f"to {values} JSON values; keras-mirror parses at most {limit} "
        "(`keras_mirror.saving.MAX_JSON_VALUES`): each takes memory once "
        "parsed, so it refuses the file before Keras reads it. Raise that "
        f"limit only for a file you trust. Received: filepath='{path}'")


@pytest.mark.parametrize("member", ["config.json", "metadata.json"])
def test_json_of_too_many_values_is_refused(tmp_path, monkeypatch, member):
    # Under the byte limit, 64 MiB of `[{},{},...]` made 20 million objects
    # (the process grew by 2.9 GB); the value count is held to a limit.
    members = _members(_saved(tmp_path))
    members[member] = _dense_json(members[member], 1000)
    path = _archive(tmp_path / "dense.keras", members)
    data = members[member]
    counted = 1 + sum(data.count(c) for c in (b",", b":", b"[", b"{"))
    monkeypatch.setattr(saving, "MAX_JSON_VALUES", counted - 1)
    with pytest.raises(errors.UnsafeModelError, match=_too_many(
            member, counted, counted - 1, path)):
        saving.load_model(path)
    monkeypatch.setattr(saving, "MAX_JSON_VALUES", counted)  # at the limit
    assert isinstance(saving.load_model(path), keras.Model)


def test_dense_json_bomb_is_refused_within_bounded_memory(
        tmp_path, keras_never_loads):
    # A 10 KiB file: 8 MiB of `{},` deflated. Refused by the default limits
    # before any of it is parsed: the bytes read are all it allocates.
    import tracemalloc

    members = _members(_saved(tmp_path))
    members["config.json"] = _dense_json(members["config.json"],
                                         8 * 2**20 // 3)
    path = _archive(tmp_path / "bomb.keras", members, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 64 * 2**10
    tracemalloc.start()
    try:
        with pytest.raises(errors.UnsafeModelError,
                           match="JSON values; keras-mirror parses at most "
                           "1048576"):
            saving.load_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20, peak  # parsed, it is about 400 MB


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED,
                                         zipfile.ZIP_DEFLATED])
def test_padded_config_is_refused_before_keras_reads_it(
        tmp_path, monkeypatch, keras_never_loads, compression):
    # Valid JSON padded with 2 MiB of spaces (main loaded 300 MiB so,
    # growing by 579 MB); the limit is lowered to keep the test small.
    monkeypatch.setattr(saving, "MAX_JSON_BYTES", 2**20)
    members = _members(_saved(tmp_path))
    members["config.json"] += b" " * 2**21
    path = _archive(tmp_path / "padded.keras", members, compression)
    with pytest.raises(errors.UnsafeModelError, match=_too_large(
            "config.json", f"declares {len(members['config.json'])}",
            2**20, "MAX_JSON_BYTES", path)):
        saving.load_model(path)


@pytest.mark.parametrize("member, knob", [
    ("metadata.json", "MAX_JSON_BYTES"), ("config.json", "MAX_JSON_BYTES"),
    ("model.weights.h5", "MAX_MEMBER_BYTES"),
    ("assets/vocabulary.txt", "MAX_MEMBER_BYTES")])
def test_every_member_is_held_to_its_limit(tmp_path, monkeypatch, member,
                                           knob):
    # Each target made the largest of its kind, so that it alone is over.
    members = _members(_saved(tmp_path))
    if member == "metadata.json":
        members[member] += b" " * 4000
    if member.startswith("assets/"):
        members[member] = b"word\n" * 4000
    path = _archive(tmp_path / "m.keras", members)
    size = len(members[member])
    others = {"MAX_JSON_BYTES": 2**20, "MAX_MEMBER_BYTES": 2**20}
    for name, value in dict(others, **{knob: size - 1}).items():
        monkeypatch.setattr(saving, name, value)
    with pytest.raises(errors.UnsafeModelError, match=_too_large(
            member, f"declares {size}", size - 1, knob, path)):
        saving.load_model(path)
    monkeypatch.setattr(saving, knob, size)  # at the limit: loads
    assert isinstance(saving.load_model(path), keras.Model)


def test_member_that_lies_about_its_size_is_refused(tmp_path,
                                                    keras_never_loads):
    # The central directory declares 100 bytes of config.json; 2 MiB are
    # stored. Only the declared bytes are read, and their CRC-32 fails.
    members = _members(_saved(tmp_path))
    members["config.json"] += b" " * 2**21
    path = _archive(tmp_path / "lying.keras", members)
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02")
    while raw[entry + 46:entry + 46 + 11] != b"config.json":
        entry = raw.index(b"PK\x01\x02", entry + 4)
    raw[entry + 24:entry + 28] = (100).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(errors.ModelFileError, match=re.escape(
            "`filepath` must be an intact `.keras` archive, but it is "
            "corrupt (Bad CRC-32 for file 'config.json'). Save the model "
            f"again or load an earlier copy. Received: filepath='{path}'")):
        saving.load_model(path)


def test_bytes_read_are_counted_whatever_the_size_declared(
        tmp_path, monkeypatch, keras_never_loads):
    # Should a member yield more than it declares, reading stops one byte
    # past the limit.
    path = _saved(tmp_path)
    monkeypatch.setattr(saving, "MAX_JSON_BYTES", 2**20)
    served = []

    class Endless(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, buffer):
            served.append(len(buffer))
            buffer[:] = b" " * len(buffer)
            return len(buffer)

    original = zipfile.ZipFile.open

    def open_(archive, name, *args, **kwargs):
        if getattr(name, "filename", name) == "metadata.json":
            return io.BufferedReader(Endless())
        return original(archive, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", open_)
    with pytest.raises(errors.UnsafeModelError, match=_too_large(
            "metadata.json", f"decompresses to more than {2**20}", 2**20,
            "MAX_JSON_BYTES", path)):
        saving.load_model(path)
    assert sum(served) <= 2**20 + 2 * 2**16


# -- what does load ------------------------------------------------------


def test_round_trip_plain_and_mirrored(tmp_path, cpus, safe_mode_state,
                                       no_unsafe_switch):
    model = _model()
    model.compile(optimizer="sgd", loss="mse")  # saved with the model
    mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
    x = np.random.rand(10, 3).astype("float32")
    mirrored.fit(x, np.random.rand(10, 2), batch_size=5, verbose=0)
    path = tmp_path / "trained.keras"
    mirrored.save(path)
    plain = saving.load_model(path)
    assert not isinstance(plain, keras_mirror.MirroredModel)
    for a, b in zip(plain.get_weights(), mirrored.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    again = saving.load_model(path, devices=cpus[:2],
                                    on_nonfinite="skip_step")
    assert isinstance(again, keras_mirror.MirroredModel)
    assert again.num_replicas == 2 and again.on_nonfinite == "skip_step"
    assert again.compiled
    np.testing.assert_allclose(again.predict(x, verbose=0),
                               mirrored.predict(x, verbose=0), atol=1e-6)


def test_mirrored_kwargs_need_devices(tmp_path):
    with pytest.raises(ValueError, match="Received: devices=None"):
        saving.load_model(_saved(tmp_path), batch="per_replica")


@keras.saving.register_keras_serializable(package="SafetyTest")
class Doubler(keras.layers.Layer):
    def call(self, x):
        return 2.0 * x


def test_registered_custom_object_loads(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, Doubler()(inputs))
    loaded = saving.load_model(_saved(tmp_path, model))
    assert isinstance(loaded.layers[-1], Doubler)


def test_custom_objects_argument_is_trusted(tmp_path):
    class Tripler(keras.layers.Layer):
        def call(self, x):
            return 3.0 * x

    inputs = keras.Input((3,))
    path = _saved(tmp_path, keras.Model(inputs, Tripler()(inputs)))
    with pytest.raises(errors.UnsafeModelError, match="Tripler"):
        saving.load_model(path)
    loaded = saving.load_model(path,
                                     custom_objects={"Tripler": Tripler})
    assert isinstance(loaded.layers[-1], Tripler)


# -- what is written -----------------------------------------------------


@pytest.mark.parametrize("name", ["m.h5", "m.hdf5", "m.tf", "m"])
def test_save_writes_only_keras(tmp_path, cpus, name):
    mirrored = keras_mirror.MirroredModel(_model(), devices=cpus[:2])
    with pytest.raises(ValueError, match="Received: filepath="):
        mirrored.save(tmp_path / name)
    with pytest.raises(ValueError, match="Received: filepath="):
        mirrored.save_weights(tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    mirrored.save(tmp_path / "m.keras")
    mirrored.save_weights(tmp_path / "m.weights.h5")
    assert zipfile.is_zipfile(tmp_path / "m.keras")
    mirrored.load_weights(tmp_path / "m.weights.h5")


# -- the source never weakens safe mode -----------------------------------


def _calls(tree, name):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            if called == name:
                yield node


def test_source_never_enables_unsafe_deserialization():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not list(_calls(tree, "enable_unsafe_deserialization")), path
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "safe_mode":
                assert ast.literal_eval(node.value) is True, path
        for call in _calls(tree, "load_model"):
            if isinstance(call.func, ast.Attribute) and isinstance(
                    call.func.value, ast.Name) and call.func.value.id in (
                    "saving",) and path.name != "saving.py":
                continue  # keras_mirror.saving.load_model is safe itself
            kwargs = {k.arg: k.value for k in call.keywords}
            assert "safe_mode" in kwargs, (path, call.lineno)
            assert ast.literal_eval(kwargs["safe_mode"]) is True


def test_keras_version_is_checked(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "3.13.2")
    with pytest.raises(ImportError, match=r"Keras >= 3\.14.*3\.13\.2"):
        _compat.check_keras_version()
    with pytest.raises(ImportError):
        saving.load_model("whatever.keras")


# -- atomic saves (issue 16, defect 3) ------------------------------------

KILL_WORKER = helpers.WORKERS / "kill_mid_save.py"


def _run_killed(mode, directory):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE.parent)] + sys.path))
    proc = subprocess.run(
        [sys.executable, str(KILL_WORKER), mode, str(directory)],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "killing myself mid-save" in proc.stdout
    with np.load(directory / "first.npz") as f:
        return [f[k] for k in f.files]


def _max_diff(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


@pytest.mark.timeout(150)
def test_kill_mid_save_keeps_the_previous_file(tmp_path, cpus):
    first = _run_killed("save", tmp_path)
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert _max_diff(loaded.get_weights(), first) == 0.0
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp." in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith(".model.keras.")
    # The next save of the same file removes the killed save's temporary.
    mirrored = keras_mirror.MirroredModel(loaded, devices=cpus[:2])
    mirrored.save(tmp_path / "model.keras")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "first.npz", "model.keras"]


@pytest.mark.timeout(150)
def test_kill_mid_model_checkpoint_keeps_the_previous_file(tmp_path):
    first = _run_killed("checkpoint", tmp_path)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.load_weights(tmp_path / "ckpt.weights.h5")
    assert _max_diff(model.get_weights(), first) == 0.0


class _Boom(Exception):
    pass


@pytest.mark.parametrize("method,name", [
    ("save", "m.keras"), ("save_weights", "m.weights.h5")])
def test_failed_save_leaves_the_old_file_and_no_temporary(
        tmp_path, cpus, monkeypatch, method, name):
    mirrored = keras_mirror.MirroredModel(_model(), devices=cpus[:2])
    getattr(mirrored, method)(tmp_path / name)
    before = (tmp_path / name).read_bytes()

    def fail(self, *args, **kwargs):
        raise _Boom()

    monkeypatch.setattr(zipfile.ZipFile, "close", fail)
    monkeypatch.setattr(h5py.File, "close", fail)
    with pytest.raises(_Boom):
        getattr(mirrored, method)(tmp_path / name)
    monkeypatch.undo()
    assert (tmp_path / name).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [name]


def test_save_to_a_directory_or_a_missing_one(tmp_path, cpus):
    mirrored = keras_mirror.MirroredModel(_model(), devices=cpus[:2])
    folder = tmp_path / "folder.keras"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match=(
            "`filepath` must name a file, not a directory. Received: "
            f"filepath='{folder}'")):
        mirrored.save(folder)
    missing = tmp_path / "nope" / "m.weights.h5"
    with pytest.raises(FileNotFoundError, match=(
            f"`filepath` must be in an existing directory; "
            f"'{tmp_path / 'nope'}' does not exist")):
        mirrored.save_weights(missing)
