"""Bad inputs and configurations, each answered by a clear Keras-style error.

`CASES` is the table behind `docs/errors.md`: the argument, the bad value,
a function that makes the mistake, the exception class and a pattern that
the message must match (the argument in backticks and `Received:` with the
value). Keep the two in step: `test_docs_table_lists_every_case` checks
that the doc has a row per case.

Also the tests of `keras_mirror/wrapper/_arguments.py`.
"""

import dataclasses
import json
import os
import re
import warnings
import zipfile
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf
from support import helpers
from support.helpers import own_step_model
from support.refusals import REFUSALS
from support.refusals import assert_keras_style
from support.refusals import trained

import keras_mirror
from keras_mirror import cluster
from keras_mirror import errors
from keras_mirror import launch
from keras_mirror import saving
from keras_mirror.callbacks.step_backup import StepBackup
from keras_mirror.distribute import _worker_input

ROOT = str(helpers.ROOT)
X = np.ones((8, 3), "float32")
Y = np.ones((8, 1), "float32")


def _seq():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def _mirrored(cpus, model=None, loss="mse", **kwargs):
    mirrored = keras_mirror.MirroredModel(model or _seq(), devices=cpus,
                                          **kwargs)
    mirrored.compile(optimizer="sgd", loss=loss)
    return mirrored


def _fit(cpus, *args, mirrored_kwargs=None, **kwargs):
    mirrored = _mirrored(cpus, **(mirrored_kwargs or {}))
    mirrored.fit(*args, verbose=0, **kwargs)


def _ds(*parts, batch=2):
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch)


def _dict_model():
    a = keras.Input((2,), name="a")
    b = keras.Input((3,), name="b")
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, out)


class _Batches(keras.utils.PyDataset):
    def __len__(self):
        return 7

    def __getitem__(self, i):
        return X[:2], Y[:2]


def _synchronized_bn():
    return keras.Sequential([
        keras.Input((3,)), keras.layers.BatchNormalization(synchronized=True),
        keras.layers.Dense(1)])


class _RootSumSquare(keras.losses.Loss):
    def __init__(self):
        super().__init__(name="root_sum_square")

    def call(self, y_true, y_pred):
        return keras.ops.sqrt(keras.ops.sum(keras.ops.square(y_true - y_pred)))


class _MedianLoss(keras.losses.Loss):
    """Reduces its own way: a reduction Keras does not define."""

    def __init__(self):
        super().__init__(name="median_loss")
        self.reduction = "median"

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.median(keras.ops.abs(y_true - y_pred))


class _OwnComputeLoss(keras.Model):
    def compute_loss(self, *args, **kwargs):
        return 2.0 * super().compute_loss(*args, **kwargs)


def _own_compute_loss():
    inputs = keras.Input((3,))
    return _OwnComputeLoss(inputs, keras.layers.Dense(1)(inputs))


class _RootAddLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.sqrt(keras.ops.sum(keras.ops.square(x))))
        return x


def _root_add_loss():
    a = keras.Input((3,))
    return keras.Model(a, keras.layers.Dense(1)(_RootAddLoss(name="root")(a)))


def _unassigned_resolver(cpus):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["h1:2222", "h2:2222"]}))
    return keras_mirror.MirroredModel(_seq(), cpus, cluster=resolver)


def _shard_shuffled(cpus):
    worker = type("Worker", (), dict(
        local_replica_ids=(0, 1), num_replicas=4, devices=("a", "b"),
        batch_mode="global", worker_input="shard", num_workers=2))
    return _worker_input.shard_fit_input(worker, X, Y, 8, {})


def _records(files, shuffle=False):
    """A TFRecord pipeline over `files` files of 4 rows, in the cwd."""
    names = []
    for i in range(files):
        names.append(f"part-{i}.tfrecord")
        with tf.io.TFRecordWriter(names[-1]) as writer:
            for _ in range(4):
                writer.write(tf.io.serialize_tensor(X[0]).numpy())
    ds = tf.data.TFRecordDataset(names).map(
        lambda r: (tf.ensure_shape(tf.io.parse_tensor(r, tf.float32), [3]),
                   tf.ones([1])))
    return (ds.shuffle(4) if shuffle else ds).batch(8)


def _sharded_fit(cpus, files=8, shuffle=False, virtual_shards=4, ds=None):
    mirrored = _mirrored(cpus, worker_input="shard",
                         virtual_shards=virtual_shards)
    tf.random.set_seed(None)  # else TF derives a seed for `shuffle`
    mirrored.fit(_records(files, shuffle) if ds is None else ds, verbose=0)


def _tf_config(text):
    return lambda cpus: cluster.cluster_from_env({"TF_CONFIG": text})


def _on_backend(name):
    """Builds a MirroredModel while Keras reports the backend `name`."""
    def make(cpus):
        original = keras.backend.backend
        keras.backend.backend = lambda: name
        try:
            keras_mirror.MirroredModel(_seq(), devices=cpus)
        finally:
            keras.backend.backend = original
    return make


@dataclasses.dataclass
class Case:
    argument: str
    value: str
    make: Callable
    error: type
    match: str


# -- issue 16: helpers for the cases below --------------------------------

def _saved_keras(name="m.keras"):
    _seq().save(name)
    return name


def _truncated_keras():
    path = _saved_keras()
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])
    return path


def _truncated_weights():
    _seq().save_weights("w.weights.h5")
    with open("w.weights.h5", "rb") as f:
        data = f.read()
    with open("w.weights.h5", "wb") as f:
        f.write(data[:len(data) // 2])
    return "w.weights.h5"


def _flipped_keras():
    path = _saved_keras()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    with open(path, "wb") as f:
        f.write(bytes(data))
    return path


def _keras_with_config(text):
    path = _saved_keras()
    with zipfile.ZipFile(path) as z:
        items = {i: z.read(i) for i in z.namelist()}
    items["config.json"] = text
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items.items():
            z.writestr(name, data)
    return path


def _builtins_eval_keras():
    path = _saved_keras()
    with zipfile.ZipFile(path) as z:
        config = json.loads(z.read("config.json"))
    dense = config["config"]["layers"][-1]["config"]
    dense["activation"] = {"module": "builtins", "class_name": "function",
                           "config": "eval", "registered_name": "function"}
    return _keras_with_config(json.dumps(config))


def _stateful(cpus):
    keras_mirror.MirroredModel(keras.Sequential([
        keras.Input((5, 3), batch_size=8),
        keras.layers.LSTM(2, stateful=True, name="lstm")]), devices=cpus)


def _optimizer_replaced(cpus):
    model = _seq()
    model.compile(optimizer="sgd", loss="mse")
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    model.optimizer = keras.optimizers.Adam()
    mirrored.fit(X, Y, verbose=0)


def _in_scope(cpus):
    with tf.distribute.OneDeviceStrategy(cpus[0]).scope():
        keras_mirror.MirroredModel(_seq(), cpus)


def _make_dir_and_save(cpus):
    os.mkdir("folder.keras")
    _mirrored(cpus).save("folder.keras")


class _Gather(keras.layers.Layer):
    def call(self, x):
        return keras_mirror.replica_context().all_gather(x)


CASES = {
    "keras_backend": Case(
        "KERAS_BACKEND", "'jax'", _on_backend("jax"), ValueError,
        r"keras-mirror needs Keras's TensorFlow backend .*Received: "
        r"keras.backend.backend\(\)='jax'"),
    "model_type": Case(
        "model", "42 (not a keras.Model)",
        lambda cpus: keras_mirror.MirroredModel(42, devices=cpus),
        TypeError, r"`model` must be a `keras.Model`.*Received: model=42"),
    "model_built_without_weights": Case(
        "model", "a factory of a subclass marked built by build()",
        lambda cpus: keras_mirror.MirroredModel(_built_by_build, cpus),
        errors.ModelRebuildError,
        r"`model` is marked built but has no weights: its layers "
        r"\['dense(_\d+)?'\] were never built .*Received: model=OwnStep"),
    "model_already_wrapped": Case(
        "model", "a MirroredModel",
        lambda cpus: keras_mirror.MirroredModel(
            keras_mirror.MirroredModel(_seq(), cpus), cpus),
        ValueError, r"`model` is already a `MirroredModel`.*Received: model="),
    "loss_neither_sum_nor_mean": Case(
        "loss", "a Loss returning sqrt(batch sum)",
        lambda cpus: _fit(cpus, X, Y, batch_size=4,
                          mirrored_kwargs={"loss": _RootSumSquare()}),
        errors.LossReductionError,
        r"The loss of output 'root_sum_square' is neither .*Received: "
        r"loss=root_sum_square for output 'root_sum_square'"),
    "add_loss_neither_sum_nor_mean": Case(
        "add_loss", "add_loss(sqrt(batch sum)) in a layer",
        lambda cpus: _fit(cpus, X, Y, batch_size=4,
                          mirrored_kwargs={"model": _root_add_loss()}),
        errors.LossReductionError,
        r"The term added by layer 'root' is neither .*Received: add_loss "
        r"term 0 of layer 'root'"),
    "devices_empty": Case(
        "devices", "[]",
        lambda cpus: keras_mirror.MirroredModel(_seq(), devices=[]),
        errors.DeviceError,
        r"`devices` must name at least one device\. Received: devices=\[\]"),
    "devices_duplicate": Case(
        "devices", "['/cpu:0', '/cpu:0']",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), devices=["/cpu:0", "/cpu:0"]),
        errors.DeviceError,
        r"`devices` must not name a device twice\. Received: devices="),
    "devices_unknown": Case(
        "devices", "['/gpu:7']",
        lambda cpus: keras_mirror.MirroredModel(_seq(), devices=["/gpu:7"]),
        errors.DeviceError,
        r"`devices` names an unknown device.*Received: devices=\['/gpu:7'\]"),
    "devices_string": Case(
        "devices", "'/cpu:0' (a string, not a list)",
        lambda cpus: keras_mirror.MirroredModel(_seq(), devices="/cpu:0"),
        errors.DeviceError,
        r"`devices` must be a list.*Received: devices='/cpu:0'"),
    "devices_not_a_name": Case(
        "devices", "[0] (an index, not a name)",
        lambda cpus: keras_mirror.MirroredModel(_seq(), devices=[0]),
        errors.DeviceError,
        r"Each entry of `devices` must be a device name \(a string, such "
        r"as '/gpu:0'\) or a `tf\.config\.LogicalDevice`\. "
        r"Received: devices=\[0\]"),
    "devices_no_index": Case(
        "devices", "['/cpu']",
        lambda cpus: keras_mirror.MirroredModel(_seq(), devices=["/cpu"]),
        errors.DeviceError,
        r"`devices` must name one device.*Received: devices entry '/cpu'"),
    "logical_cpus_late": Case(
        "n", "2, after TensorFlow initialised 4 logical CPUs",
        lambda cpus: keras_mirror.logical_cpus(2),
        errors.DevicesAlreadyInitializedError,
        r"`logical_cpus\(n\)` must run before.*Received: n=2"),
    "logical_cpus_zero": Case(
        "n", "0",
        lambda cpus: keras_mirror.logical_cpus(0),
        ValueError, r"`n` must be a positive integer\. Received: n=0"),
    "batch_mode": Case(
        "batch", "'local'",
        lambda cpus: keras_mirror.MirroredModel(_seq(), cpus, batch="local"),
        ValueError, r"`batch` must be one of .*Received: batch='local'"),
    "execution": Case(
        "execution", "'graph'",
        lambda cpus: keras_mirror.MirroredModel(_seq(), cpus,
                                                execution="graph"),
        ValueError,
        r"`execution` must be one of \('auto', 'strategy'\)\. "
        r"Received: execution='graph'"),
    "execution_in_graph_removed": Case(
        "execution", "'in_graph' (removed)",
        lambda cpus: keras_mirror.MirroredModel(_seq(), cpus,
                                                execution="in_graph"),
        ValueError,
        r"`execution='in_graph'` was removed in keras-mirror 0\.2: every "
        r"device now runs the one `tf\.distribute` path.*Omit `execution`.*"
        r"Received: execution='in_graph'"),
    "on_nonfinite": Case(
        "on_nonfinite", "'ignore'",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, on_nonfinite="ignore"),
        ValueError,
        r"`on_nonfinite` must be one of .*Received: on_nonfinite='ignore'"),
    "replica_stats": Case(
        "replica_stats", "'no'",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, replica_stats="no"),
        ValueError,
        r"`replica_stats` must be True or False\. "
        r"Received: replica_stats='no'"),
    "replica_tensorboard_without_stats": Case(
        "replica_stats", "False with ReplicaTensorBoard",
        lambda cpus: _fit_with_board(cpus),
        ValueError,
        r"ReplicaTensorBoard writes per-replica statistics, and this "
        r"MirroredModel computes none\..*Received: replica_stats=False"),
    "gradient_dtype": Case(
        "gradient_dtype", "'int8'",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, gradient_dtype="int8"),
        ValueError,
        r"`gradient_dtype` must be one of.*Received: gradient_dtype='int8'"),
    "bytes_per_pack": Case(
        "bytes_per_pack", "-1",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, bytes_per_pack=-1),
        ValueError,
        r"`bytes_per_pack` must be a non-negative integer\. "
        r"Received: bytes_per_pack=-1"),
    "communication_ring_one_host": Case(
        "communication", "'ring' on one host",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, communication="ring"),
        ValueError,
        r"`communication='ring'` selects an implementation of TensorFlow's "
        r"collective ops.*Received: communication='ring'"),
    "communication_nccl_cpus": Case(
        "communication", "'nccl' with CPU devices",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, communication="nccl"),
        ValueError,
        r"`communication='nccl'` needs GPU devices.*"
        r"Received: communication='nccl' with devices="),
    "communication": Case(
        "communication", "'mpi'",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, communication="mpi"),
        ValueError,
        r"`communication` must be one of .*Received: communication='mpi'"),
    "timeout_seconds": Case(
        "timeout_seconds", "0",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, timeout_seconds=0),
        ValueError,
        r"`timeout_seconds` must be positive.*Received: timeout_seconds=0"),
    "fit_before_compile": Case(
        "compiled", "False (fit before compile)",
        lambda cpus: keras_mirror.MirroredModel(_seq(), cpus).fit(X, Y),
        ValueError,
        r"`MirroredModel.fit` needs a compiled model.*"
        r"Received: compiled=False"),
    "loss_reduction": Case(
        "loss", "a Loss with reduction='median'",
        lambda cpus: _mirrored(cpus, loss=_MedianLoss()),
        ValueError, r"`loss` must have a reduction Keras defines.*"
        r"Received: loss=.*with reduction='median'"),
    "loss_weighted_mean_override": Case(
        "loss", "reduction='mean_with_sample_weight' with a compute_loss "
        "override",
        lambda cpus: _mirrored(
            cpus, model=_own_compute_loss(),
            loss=keras.losses.MeanSquaredError(
                reduction="mean_with_sample_weight")),
        ValueError, r"`loss` with reduction='mean_with_sample_weight' "
        r"cannot be weighted under a `compute_loss` override.*Received: "
        r"loss=.*compute_loss=_OwnComputeLoss.compute_loss"),
    "y_length": Case(
        "y", "7 rows for 8 rows of x",
        lambda cpus: _fit(cpus, X, Y[:7]),
        ValueError, r"`y` must have as many rows as `x` \(8\)\. "
        r"Received: y with 7 rows"),
    "sample_weight_length": Case(
        "sample_weight", "5 rows for 8 rows of x",
        lambda cpus: _fit(cpus, X, Y, sample_weight=np.ones(5)),
        ValueError, r"`sample_weight` must have as many rows as `x`.*"
        r"Received: sample_weight with 5 rows"),
    "x_no_rows": Case(
        "x", "arrays of 0 rows",
        lambda cpus: _fit(cpus, X[:0], Y[:0]),
        ValueError, r"`x` must hold at least one example\. "
        r"Received: x with shape \(0, 3\)"),
    "dataset_empty": Case(
        "x", "a dataset that yields nothing",
        lambda cpus: _fit(cpus, _ds(X, Y).take(0)),
        ValueError, r"`x` must yield at least one batch.*Received: x="),
    "targets_missing": Case(
        "y", "None with a compiled loss",
        lambda cpus: _fit(cpus, X),
        ValueError, r"`y` must be given.*Received: y=None"),
    "dataset_targets_missing": Case(
        "x", "a dataset of inputs only, with a compiled loss",
        lambda cpus: _fit(cpus, _ds(X)),
        ValueError, r"`x` must yield `\(inputs, targets\)`.*"
        r"Received: x with element_spec="),
    "input_shape": Case(
        "x", "shape (8, 5) for an input of shape (None, 3)",
        lambda cpus: _fit(cpus, np.ones((8, 5), "float32"), Y),
        ValueError, r"`x` must have the shape \(None, 3\).*"
        r"Received: x.shape=\(8, 5\)"),
    "dataset_input_shape": Case(
        "x", "a dataset of shape (None, 4) for an input of shape (None, 3)",
        lambda cpus: _fit(cpus, _ds(np.ones((8, 4), "float32"), Y)),
        ValueError, r"`x` must have the shape \(None, 3\).*"
        r"Received: x.shape=\(None, 4\)"),
    "dict_missing_key": Case(
        "x", "{'a': ...} for inputs 'a' and 'b'",
        lambda cpus: _mirrored(cpus, _dict_model()).fit(
            {"a": np.ones((8, 2))}, Y, verbose=0),
        ValueError, r"`x` must have the keys \['a', 'b'\].*"
        r"\['b'\] missing\. Received: x with keys \['a'\]"),
    "steps_per_epoch_beyond": Case(
        "steps_per_epoch", "10 for a dataset of 4 batches",
        lambda cpus: _fit(cpus, _ds(X, Y), steps_per_epoch=10),
        ValueError, r"`steps_per_epoch` must be at most the 4 step\(s\).*"
        r"Received: steps_per_epoch=10"),
    "steps_per_epoch_endless": Case(
        "steps_per_epoch", "None for a dataset repeated forever",
        lambda cpus: _fit(cpus, _ds(X, Y).repeat()),
        ValueError, r"`steps_per_epoch` must be given for an endless `x` "
        r"\(a dataset repeated forever, `\.repeat\(\)`\): without it the "
        r"epoch never ends\..*Received: steps_per_epoch=None"),
    "validation_steps_endless": Case(
        "validation_steps", "None for validation_data repeated forever",
        lambda cpus: _fit(cpus, X, Y, validation_data=_ds(X, Y).repeat()),
        ValueError, r"`validation_steps` must be given for an endless "
        r"`validation_data`.*Received: validation_steps=None"),
    "shard_hint_validation_data": Case(
        "validation_data", "a pipeline holding `shard(SHARD_HINT, "
        "SHARD_HINT)` (it failed after an epoch of training)",
        lambda cpus: _fit(cpus, X, Y, validation_data=_ds(X, Y).shard(
            tf.data.experimental.SHARD_HINT,
            tf.data.experimental.SHARD_HINT)),
        ValueError, r"`validation_data` must not hold `\.shard\(tf\.data"
        r"\.experimental\.SHARD_HINT, .*Received: validation_data with "
        r"`shard\(SHARD_HINT, SHARD_HINT\)`"),
    "steps_per_epoch_zero": Case(
        "steps_per_epoch", "0",
        lambda cpus: _fit(cpus, X, Y, steps_per_epoch=0),
        ValueError, r"`steps_per_epoch` must be a positive integer.*"
        r"Received: steps_per_epoch=0"),
    "batch_size_zero": Case(
        "batch_size", "0",
        lambda cpus: _fit(cpus, X, Y, batch_size=0),
        ValueError, r"`batch_size` must be a positive integer.*"
        r"Received: batch_size=0"),
    "per_replica_ragged_dataset": Case(
        "x", "7 batches with batch='per_replica' on 4 replicas",
        lambda cpus: _fit(cpus, _ds(X, Y, batch=1).take(7),
                          mirrored_kwargs={"batch": "per_replica"}),
        ValueError, r"`batch='per_replica'` needs the number of batches.*"
        r"Received: x with 7 batches"),
    "per_replica_ragged_pydataset": Case(
        "x", "a PyDataset of 7 batches with batch='per_replica'",
        lambda cpus: _fit(cpus, _Batches(),
                          mirrored_kwargs={"batch": "per_replica"}),
        ValueError, r"`batch='per_replica'` needs the number of batches.*"
        r"Received: x with 7 batches"),
    "per_replica_validation_batch": Case(
        "validation_data", "batches of 4 rows for training batches of 8, "
        "batch='per_replica'",
        lambda cpus: _fit(cpus, _ds(X, Y, batch=8).repeat(4),
                          validation_data=_ds(X, Y, batch=4).repeat(2),
                          mirrored_kwargs={"batch": "per_replica"}),
        ValueError, r"`validation_data` must have the per-replica batch "
        r"size of `x` \(8 rows\).*Received: validation_data with batches "
        r"of 4 rows"),
    "split_plan": Case(
        "batch_size", "-1",
        lambda cpus: keras_mirror.MirroredModel(_seq(), cpus).split_plan(-1),
        ValueError, r"`batch_size` must be a non-negative integer\. "
        r"Received: batch_size=-1"),
    "save_h5": Case(
        "filepath", "'model.h5'",
        lambda cpus: _mirrored(cpus).save("model.h5"),
        ValueError, r"`filepath` must end in `.keras`.*"
        r"Received: filepath='model.h5'"),
    "save_weights_suffix": Case(
        "filepath", "'model.h5' for save_weights",
        lambda cpus: _mirrored(cpus).save_weights("model.h5"),
        ValueError, r"`filepath` must end in `.weights.h5`\. "
        r"Received: filepath='model.h5'"),
    "load_weights_full_model": Case(
        "filepath", "'model.keras' for load_weights",
        lambda cpus: _mirrored(cpus).load_weights("model.keras"),
        ValueError, r"`filepath` must end in `.weights.h5`.*"
        r"Received: filepath='model.keras'"),
    "load_model_h5": Case(
        "filepath", "'model.h5' (legacy full model)",
        lambda cpus: saving.load_model("model.h5"),
        errors.UnsafeModelError, r"`filepath` must be a `.keras` file.*"
        r"Received: filepath='model.h5'"),
    "worker_input": Case(
        "worker_input", "'files'",
        lambda cpus: keras_mirror.MirroredModel(_seq(), cpus,
                                                worker_input="files"),
        ValueError, r"`worker_input` must be one of \('replicate', "
        r"'shard'\).*Received: worker_input='files'"),
    "worker_input_shard_shuffle": Case(
        "shuffle", "True (the default) with worker_input='shard'",
        _shard_shuffled, ValueError,
        r"`worker_input='shard'` needs `shuffle=False`.*Received: "
        r"shuffle=True"),
    "virtual_shards_files": Case(
        "virtual_shards", "4, over a pipeline reading 2 files",
        lambda cpus: _sharded_fit(cpus, files=2), ValueError,
        r"`virtual_shards` must be at most the number of files the pipeline "
        r"reads \(2\).*Received: virtual_shards=4"),
    "virtual_shards_batch": Case(
        "virtual_shards", "16, over a pipeline of `batch(8)` on 16 files",
        lambda cpus: _sharded_fit(cpus, files=16, virtual_shards=16),
        ValueError, r"`virtual_shards` must be at most the pipeline's batch "
        r"size \(8\).*Received: virtual_shards=16"),
    "virtual_shards_unshardable": Case(
        "worker_input",
        "a `from_tensor_slices` pipeline with worker_input='shard'",
        lambda cpus: _sharded_fit(cpus, ds=_ds(X, Y, batch=8)), ValueError,
        r"`worker_input='shard'` shards a `tf.data` pipeline by the files "
        r"it reads.*Received: a pipeline without a file reader or "
        r"`SHARD_HINT`"),
    "virtual_shards_shuffle": Case(
        "shuffle",
        "a pipeline with `shuffle(4)` (no seed), worker_input='shard'",
        lambda cpus: _sharded_fit(cpus, shuffle=True), ValueError,
        r"`worker_input='shard'` needs a `seed` on every `shuffle`.*"
        r"Received: a pipeline with 1 `shuffle` without a seed"),
    "virtual_shards_replicate": Case(
        "virtual_shards", "2 with worker_input='replicate'",
        lambda cpus: _mirrored(cpus, virtual_shards=2), ValueError,
        r"`virtual_shards` needs `worker_input='shard'`.*Received: "
        r"worker_input='replicate'"),
    "virtual_shards_workers": Case(
        "virtual_shards", "2 on a cluster of 3 workers",
        lambda cpus: _worker_input.check_virtual_shards(
            2, "shard", type("Spec", (), {"num_workers": 3})), ValueError,
        r"`virtual_shards` must be at least the number of workers \(3\).*"
        r"Received: virtual_shards=2"),
    "cluster_resolver_task": Case(
        "cluster", "a ClusterResolver without task_type",
        _unassigned_resolver, errors.ClusterConfigError,
        r"`cluster` \(SimpleClusterResolver\) does not say which task.*"
        r"Received: cluster="),
    "init_cpus_per_worker": Case(
        "cpus_per_worker", "0",
        lambda cpus: keras_mirror.init(cpus_per_worker=0), ValueError,
        r"`cpus_per_worker` must be a positive integer\. "
        r"Received: cpus_per_worker=0"),
    "launch_min_workers": Case(
        "min_workers", "3 with num_workers=2",
        lambda cpus: launch.launch(["python", "train.py"], 2, min_workers=3),
        ValueError, r"`min_workers` must be at most `num_workers` \(2\)\. "
        r"Received: min_workers=3"),
    "tf_config_json": Case(
        "TF_CONFIG", "'{\"cluster\": ' (bad JSON)",
        _tf_config('{"cluster": '),
        errors.ClusterConfigError,
        r"`TF_CONFIG` is not valid JSON.*Received: TF_CONFIG="),
    "tf_config_task": Case(
        "TF_CONFIG", "no \"task\" key",
        _tf_config('{"cluster": {"worker": ["127.0.0.1:2222"]}}'),
        errors.ClusterConfigError,
        r"`TF_CONFIG` has no \"task\" key.*Received: TF_CONFIG="),
    "tf_config_index": Case(
        "TF_CONFIG['task']['index']", "5 for 2 workers",
        _tf_config('{"cluster": {"worker": ["127.0.0.1:2222", '
                   '"127.0.0.1:2223"]}, "task": {"type": "worker", '
                   '"index": 5}}'),
        errors.ClusterConfigError,
        r"`TF_CONFIG\['task'\]\['index'\]` must be in \[0, 2\).*"
        r"Received: TF_CONFIG\['task'\]\['index'\]=5"),
    "x_string": Case(
        "x", "'data.csv' (a string)",
        lambda cpus: _fit(cpus, "data.csv", Y),
        ValueError, r"`x` must be arrays, a `tf.data.Dataset`, a "
        r"`keras.utils.PyDataset` or a generator, not a string\. "
        r"Received: x='data.csv'"),
    "y_object_array": Case(
        "y", "a NumPy array of dtype object (rows of different lengths)",
        lambda cpus: _fit(cpus, X[:2], np.array([[1.0], [1.0, 2.0]],
                                                dtype=object)),
        ValueError, r"`y` must hold numbers \(or strings\), not Python "
        r"objects.*Received: y with dtype=object"),
    "y_strings": Case(
        "y", "string labels",
        lambda cpus: _fit(cpus, X, np.array(["cat"] * 8)),
        ValueError, r"`y` must hold numbers, which a loss can compare.*"
        r"Received: y with dtype=<U3"),
    "evaluate_input_shape": Case(
        "x", "shape (8, 4) in `evaluate` for an input of shape (None, 3)",
        lambda cpus: _mirrored(cpus).evaluate(np.ones((8, 4)), Y, verbose=0),
        ValueError, r"`x` must have the shape \(None, 3\) \(None: any "
        r"size\) of the model's input\. Received: x.shape=\(8, 4\)"),
    "train_on_batch_input_shape": Case(
        "x", "shape (8, 4) in `train_on_batch`",
        lambda cpus: _mirrored(cpus).train_on_batch(np.ones((8, 4)), Y),
        ValueError, r"`x` must have the shape \(None, 3\).*"
        r"Received: x.shape=\(8, 4\)"),
    "generator_input_shape": Case(
        "x", "a generator of batches of shape (2, 4)",
        lambda cpus: _fit(cpus, ((np.ones((2, 4), "float32"), Y[:2])
                                 for _ in range(4))),
        ValueError, r"`x` must have the shape \(None, 3\).*"
        r"Received: x.shape=\(2, 4\)"),
    "validation_data_shape": Case(
        "validation_data", "inputs of shape (4, 4), checked before training",
        lambda cpus: _fit(cpus, X, Y,
                          validation_data=(np.ones((4, 4)), Y[:4])),
        ValueError, r"`validation_data` must have the shape \(None, 3\).*"
        r"Received: validation_data.shape=\(4, 4\)"),
    "dataset_sample_weight_rows": Case(
        "x", "a dataset whose batches hold 5 sample weights for 8 rows",
        lambda cpus: _fit(cpus, tf.data.Dataset.from_tensors(
            (X, Y, np.ones(5, "float32")))),
        ValueError, r"Each batch of `x` must have as many sample_weight "
        r"rows as input rows \(8\)\. Received: a batch with 5 "
        r"sample_weight rows and 8 input rows"),
    "class_weight_list": Case(
        "class_weight", "[1.0, 2.0] (a list)",
        lambda cpus: _fit(cpus, X, Y, class_weight=[1.0, 2.0]),
        ValueError, r"`class_weight` must be a dict mapping class indices "
        r"\(ints\) to weights\. Received: class_weight=\[1.0, 2.0\]"),
    "devices_garbage": Case(
        "devices", "['garbage']",
        lambda cpus: keras_mirror.MirroredModel(_seq(), ["garbage"]),
        errors.DeviceError, r"Each entry of `devices` must name one device "
        r"with its type and index.*Received: devices entry 'garbage'"),
    "devices_other_task": Case(
        "devices", "['/job:worker/task:3/device:CPU:0']",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), ["/job:worker/task:3/device:CPU:0"]),
        errors.DeviceError, r"`devices` names "
        r"'/job:worker/task:3/device:CPU:0', a device of another job or "
        r"task.*Received: devices="),
    "timeout_seconds_string": Case(
        "timeout_seconds", "'5' (a string)",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, timeout_seconds="5"),
        ValueError, r"`timeout_seconds` must be positive \(seconds\) or "
        r"None\. Received: timeout_seconds='5'"),
    "timeout_seconds_bool": Case(
        "timeout_seconds", "True",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, timeout_seconds=True),
        ValueError, r"`timeout_seconds` must be positive.*"
        r"Received: timeout_seconds=True"),
    "bytes_per_pack_bool": Case(
        "bytes_per_pack", "True",
        lambda cpus: keras_mirror.MirroredModel(
            _seq(), cpus, bytes_per_pack=True),
        ValueError, r"`bytes_per_pack` must be a non-negative integer\. "
        r"Received: bytes_per_pack=True"),
    "save_to_directory": Case(
        "filepath", "an existing directory 'folder.keras'",
        _make_dir_and_save,
        IsADirectoryError, r"`filepath` must name a file, not a "
        r"directory\. Received: filepath='folder.keras'"),
    "save_to_missing_directory": Case(
        "filepath", "'missing/m.keras'",
        lambda cpus: _mirrored(cpus).save("missing/m.keras"),
        FileNotFoundError, r"`filepath` must be in an existing directory; "
        r"'.*missing' does not exist.*Received: filepath='missing/m.keras'"),
    "load_model_empty": Case(
        "filepath", "an empty `.keras` file",
        lambda cpus: saving.load_model(open("m.keras", "w").close()
                                       or "m.keras"),
        errors.ModelFileError, r"`filepath` must be a complete `.keras` "
        r"archive, but the file is empty.*Received: filepath='m.keras'"),
    "load_model_truncated": Case(
        "filepath", "a `.keras` file cut in half",
        lambda cpus: saving.load_model(_truncated_keras()),
        errors.ModelFileError, r"`filepath` must be a complete `.keras` "
        r"archive, but the file is a truncated zip archive.*"
        r"Received: filepath='m.keras'"),
    "load_model_corrupt": Case(
        "filepath", "a `.keras` file with 64 flipped bytes",
        lambda cpus: saving.load_model(_flipped_keras()),
        errors.ModelFileError, r"`filepath` must be an intact `.keras` "
        r"archive, but it is corrupt.*Received: filepath='m.keras'"),
    "load_model_deep_json": Case(
        "filepath", "a config.json nested 100000 levels deep",
        lambda cpus: saving.load_model(_keras_with_config(
            "[" * 100000 + "]" * 100000)),
        errors.UnsafeModelError, r"`filepath` holds a `config.json` nested "
        r"too deeply.*Received: filepath='m.keras'"),
    "load_model_builtins_eval": Case(
        "filepath", "a config naming `builtins.eval` as an activation",
        lambda cpus: saving.load_model(_builtins_eval_keras()),
        errors.UnsafeModelError, r"config names the Python builtin 'eval' "
        r"\(module 'builtins'\), which is not a Keras function.*"
        r"Received: filepath='m.keras'"),
    "load_weights_truncated": Case(
        "filepath", "a `.weights.h5` file cut in half",
        lambda cpus: _mirrored(cpus).load_weights(_truncated_weights()),
        errors.ModelFileError, r"`filepath` must be a complete "
        r"`.weights.h5` file, but it cannot be opened .*it is empty, "
        r"truncated or corrupt.*Received: filepath='w.weights.h5'"),
    "stateful_rnn": Case(
        "stateful", "LSTM(stateful=True) over 4 replicas", _stateful,
        ValueError, r"cannot split a stateful RNN over 4 replicas.*"
        r"Received: model with stateful layers \['lstm'\] and 4 replicas"),
    "optimizer_replaced": Case(
        "optimizer", "model.optimizer = Adam() after compile, no recompile",
        _optimizer_replaced,
        ValueError, r"The wrapped model's `optimizer` was replaced after it "
        r"was compiled.*Received: model.optimizer="),
    "created_in_strategy_scope": Case(
        "MirroredModel", "created inside OneDeviceStrategy.scope()",
        _in_scope,
        ValueError, r"`MirroredModel` must be created outside any "
        r"`tf.distribute.Strategy.scope\(\)`.*Received: a MirroredModel "
        r"created inside OneDeviceStrategy.scope\(\)"),
    # -- issue 24: verify, all_gather ----------------------------------------
    "verify_steps": Case(
        "steps", "0 in `verify`",
        lambda cpus: _mirrored(cpus).verify(X, Y, steps=0),
        ValueError, r"`steps` must be a positive integer\. "
        r"Received: steps=0"),
    "verify_fit_argument": Case(
        "epochs", "epochs=2 in `verify`",
        lambda cpus: _mirrored(cpus).verify(X, Y, epochs=2),
        ValueError, r"`verify` runs `steps` steps of one epoch.*`epochs` is "
        r"its own.*Received: epochs=2"),
    "verify_tolerance": Case(
        "tolerance", "-1 in `verify`",
        lambda cpus: _mirrored(cpus).verify(X, Y, tolerance=-1),
        ValueError, r"`tolerance` must be a finite non-negative number\. "
        r"Received: tolerance=-1"),
    # -- issue 41 ----------------------------------------------------------
    "input_fn_no_argument": Case(
        "input_fn", "a function of no argument, worker_input='shard'",
        lambda cpus: _shard_fit(cpus, lambda: _ds(X, Y)),
        ValueError, r"`input_fn` must take one argument, its virtual "
        r"shard's `tf.distribute.InputContext`.*Received: "
        r"input_fn=<lambda>\(\)"),
    "input_fn_shard_dtypes": Case(
        "input_fn", "float32 in virtual shard 0, float64 in shard 1",
        lambda cpus: _shard_fit(cpus, lambda c: _ds(
            X.astype(f"float{32 * (1 + c.input_pipeline_id)}"), Y)),
        ValueError, r"`input_fn` must give every virtual shard the same "
        r"structure, dtypes and shapes.*Received: virtual shard 1 yields "
        r"\(float64 \(None, 3\), float32 \(None, 1\)\), virtual shard 0 "
        r"yields \(float32"),
    "x_function": Case(
        "x", "an `input_fn` with worker_input='replicate'",
        lambda cpus: _fit(cpus, _input_function),
        ValueError, r"`x` must be arrays, .* A function "
        r"\(`input_fn\(input_context\)`\) is read only by `fit` with "
        r"`worker_input='shard'`.*Received: x=_input_function"),
    "x_strings_for_numbers": Case(
        "x", "a dataset of strings for a float32 input",
        lambda cpus: _fit(cpus, _ds(np.full((8, 3), "a"), Y)),
        ValueError, r"`x` must hold numbers for the model's input of dtype "
        r"float32\. Received: x with dtype=tf.string"),
    "callbacks_class": Case(
        "callbacks", "[keras.callbacks.History] (the class)",
        lambda cpus: _fit(cpus, X, Y, callbacks=[keras.callbacks.History]),
        ValueError, r"`callbacks` must be a list of .* `History` is a "
        r"class: pass an instance, `History\(...\)`\. Received: "
        r"callbacks\[0\]=<class"),
    "callbacks_item": Case(
        "callbacks", "[History(), 3]",
        lambda cpus: _fit(cpus, X, Y,
                          callbacks=[keras.callbacks.History(), 3]),
        ValueError, r"`callbacks` must be a list of .*Received: "
        r"callbacks\[1\]=3$"),
    "split_plan_replica_batch_size_global": Case(
        "replica_batch_size", "4 with batch='global'",
        lambda cpus: _mirrored(cpus).split_plan(13, replica_batch_size=4),
        ValueError, r"`replica_batch_size` applies to `batch='per_replica'`"
        r" only.*Received: replica_batch_size=4"),
    "replica_tensorboard_log_dir_file": Case(
        "log_dir", "the path of an existing file",
        lambda cpus: keras_mirror.ReplicaTensorBoard(_a_file("logs")),
        ValueError, r"`log_dir` must be a directory, or a path where one can"
        r" be made: it names an existing file.*Received: log_dir='logs'"),
}


def _shard_fit(cpus, input_fn):
    mirrored = _mirrored(cpus, worker_input="shard", virtual_shards=2)
    mirrored.fit(input_fn, epochs=1, verbose=0)


def _input_function(input_context):
    return _ds(X, Y)


def _a_file(name):
    with open(name, "w"):
        return name


# -- issue 23: hostile files and impossible backups ------------------------

def _traversal_keras():
    path = _saved_keras()
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("assets/../../../../x/e.txt", "escaped")
    return path


def _partial_weights(cpus):
    mirrored, _ = trained(cpus)
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                      keras.layers.Dense(2)]).save_weights("w.weights.h5")
    mirrored.load_weights("w.weights.h5")


def _impossible_backup(cpus):
    mirrored, _ = trained(cpus)
    writer = StepBackup("backup")
    writer.set_model(mirrored)
    writer.save(-1, 3)
    mirrored.fit(X, Y, batch_size=2, epochs=2, verbose=0, shuffle=False,
                 callbacks=[StepBackup("backup")])


def _built_in_other_strategy(cpus):
    with tf.distribute.MirroredStrategy(cpus[:2]).scope():
        model = _seq()
    keras_mirror.MirroredModel(model, cpus)


def _refusal(refusal):
    return lambda cpus: refusal.make(*trained(cpus, refusal.kind))


CASES.update({
    "load_model_path_traversal": Case(
        "filepath", "a `.keras` archive with a member "
        "'assets/../../../../x/e.txt'", lambda cpus: saving.load_model(
            _traversal_keras()), errors.UnsafeModelError,
        r"`filepath` holds the archive member 'assets/../../../../x/e.txt', "
        r"whose name leaves the archive.*Received: filepath='m.keras'"),
    "load_weights_partial_mismatch": Case(
        "filepath", "weights whose first layer fits and second does not",
        _partial_weights, ValueError,
        r"`filepath` holds weights that do not fit this model: .* has shape "
        r"\(4, 2\) in the file and \(4, 1\) in the model\. Nothing was "
        r"loaded\..*Received: filepath='w.weights.h5'"),
    "step_backup_position": Case(
        "backup_dir", "a backup at position [-1, 3]", _impossible_backup,
        errors.StepBackupError,
        r"The step backup 'backup/step_backup.npz' holds the position "
        r"\[-1, 3\] \(epoch, step\), which this run cannot reach: the "
        r"epoch must be in \[0, 2\].*Received: backup_dir='backup'"),
    "model_built_in_other_strategy": Case(
        "model", "built inside MirroredStrategy.scope()",
        _built_in_other_strategy, errors.StrategyScopeError,
        r"`model` must be built outside any `tf.distribute` strategy.*"
        r"Received: model='sequential.*' with MirroredVariables"),
})
CASES.update({name: Case(r.argument, r.value, _refusal(r), r.error, r.match)
              for name, r in REFUSALS.items()})


def _built_by_build():
    model = own_step_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras warns of the unbuilt state
        model.build((None, 3))
    return model


def _fit_with_board(cpus):
    mirrored = keras_mirror.MirroredModel(_seq(), cpus, replica_stats=False)
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(X, Y, batch_size=8, verbose=0,
                 callbacks=[keras_mirror.ReplicaTensorBoard("runs")])


# The `REFUSALS` (mistakes made on a trained wrapper) are asserted the same
# way by `tests/wrapper/test_validate.py`, on one trained wrapper per kind
# that they must leave untouched; here they only feed the docs' table.
@pytest.mark.parametrize("name", sorted(set(CASES) - set(REFUSALS)))
def test_error(cpus, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    case = CASES[name]
    with pytest.raises(case.error, match=case.match) as info:
        case.make(cpus)
    assert_keras_style(str(info.value), case.argument)


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_docs_table_lists_every_case():
    with open(os.path.join(ROOT, "docs", "errors.md")) as f:
        doc = f.read()
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", doc, flags=re.M)
    assert sorted(rows) == sorted(CASES)


def test_errors_subclass_builtins():
    assert issubclass(errors.DeviceError, ValueError)
    assert issubclass(errors.StrategyScopeError, ValueError)
    assert issubclass(errors.UnsafeModelError, ValueError)
    assert issubclass(errors.NonFiniteError, FloatingPointError)
    assert issubclass(errors.ClusterConfigError, ValueError)


def test_numpy_integers_are_accepted(cpus):
    """`bytes_per_pack` and `timeout_seconds` take NumPy numbers too."""
    mirrored = keras_mirror.MirroredModel(
        _seq(), cpus, bytes_per_pack=np.int64(1024),
        timeout_seconds=np.int64(5))
    assert mirrored.execution == "strategy"


def test_nested_model_config_is_not_too_deep():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    middle = keras.Sequential([keras.Input((3,)), inner])
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, keras.Sequential([middle])(inputs))
    config = keras.saving.serialize_keras_object(outer)
    assert saving._depth(config) < saving._MAX_DEPTH / 2


def test_issue16_errors_subclass_builtins():
    assert issubclass(errors.ModelFileError, ValueError)
    assert issubclass(errors.StepBackupError, ValueError)
    assert issubclass(errors.BackupDirectoryError, OSError)


def test_many_more_replicas_than_rows_warns(cpus):
    """4 replicas, global batches of 1 row: 3 shards are always empty."""
    with pytest.warns(UserWarning, match=(
            r"4 replicas for a global batch of 1 rows: 3 replicas get an "
            r"empty shard every step.*Received: batch_size=1 with 4 "
            r"replicas")):
        _fit(cpus, X[:2], Y[:2], batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _fit(cpus, X, Y, batch_size=2)  # 2 of 4 replicas busy: no warning


