"""Virtual shards: a tf.data input read in shares, exact on any cluster.

`tests/support/workers/vs_train.py` trains on 12 TFRecord files of 90 records
(`list_files(shuffle=False)`, `interleave`, a counting `map`,
`batch(12)`) with `virtual_shards=6`: shard `v` reads files `v` and
`v + 6` and gives every global batch 2 rows. The reference is computed here
without keras-mirror (NumPy: the records of each shard in interleave order,
global batch `k` = rows `2k, 2k + 1` of every shard in shard order) and
trained with plain Keras; one process, 2 workers (with an
`input_fn(input_context)`) and 3 workers, and an elastic run that shrinks
from 3 to 2 workers (`--min-workers 2`: the launcher's elastic test too),
all end within 1e-5 of it, and each worker parses only its files' records.

Also the tests of `keras_mirror/distribute/_pipeline_graph.py`.
"""

import functools
import importlib.util
import json
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from support import helpers
from support.multi_worker import load
from support.multi_worker import max_diff
from support.multi_worker import no_leftover_processes  # noqa: F401

from keras_mirror import MirroredModel
from keras_mirror import StepBackup
from keras_mirror import errors
from keras_mirror import launch as launch_lib
from keras_mirror.distribute import _virtual_shards

WORKER = helpers.WORKERS / "vs_train.py"
_spec = importlib.util.spec_from_file_location("vs_train", WORKER)
vs_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_train)
V, EPOCHS = 6, 2


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfrecords")
    vs_train.write_files(str(path))
    return path


def _interleave(a, b):
    out = []
    for i in range(max(len(a), len(b))):
        out += [r for r in (a[i:i + 1], b[i:i + 1]) if len(r)]
    return np.concatenate(out)


def reference_batches():
    """The global batches the virtual-shard rule defines, in NumPy."""
    rng = np.random.default_rng(3)
    files = [(rng.normal(size=(n, vs_train.FEATURES)).astype("float32"),
              rng.normal(size=(n, vs_train.TARGETS)).astype("float32"))
             for n in vs_train.RECORDS]
    rows = vs_train.BATCH // V
    shards = [tuple(_interleave(files[v][i], files[v + V][i])
                    for i in (0, 1)) for v in range(V)]
    steps = max(-(-len(x) // rows) for x, _ in shards)
    return [tuple(np.concatenate([s[i][k * rows:(k + 1) * rows]
                                  for s in shards]) for i in (0, 1))
            for k in range(steps)]


@functools.cache
def reference_weights():
    """Plain Keras on `reference_batches()`: (weights, steps), computed once.
    """
    model = vs_train.model()
    model.compile(optimizer=vs_train.optimizer(), loss="mse")
    batches = reference_batches()
    ds = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=(
            tf.TensorSpec((None, vs_train.FEATURES), tf.float32),
            tf.TensorSpec((None, vs_train.TARGETS), tf.float32)))
    # Of unknown length, as the user's pipeline is (`interleave`): Keras
    # counts one more optimizer iteration at each epoch's end of such an
    # input (the call that meets its end), with or without keras-mirror.
    assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    model.fit(ds, epochs=EPOCHS, verbose=0)
    steps = (len(batches) + 1) * EPOCHS
    assert int(model.optimizer.iterations.numpy()) == steps
    return model.get_weights(), steps


def _mirrored(cpus, **kwargs):
    mirrored = MirroredModel(vs_train.model(), devices=cpus[:2],
                             worker_input="shard", **kwargs)
    mirrored.compile(optimizer=vs_train.optimizer(), loss="mse")
    return mirrored


def test_one_process_stream_is_the_reference_batches(data_dir, cpus):
    mirrored = _mirrored(cpus, virtual_shards=V)
    stream = _virtual_shards.fit_dataset(
        mirrored, vs_train.pipeline(str(data_dir)))
    got = [tuple(t.numpy() for t in b) for b in stream]
    want = reference_batches()
    assert [len(b[0]) for b in got] == [12] * 4 + [11, 10, 8, 8, 4, 1]
    assert len(got) == len(want)
    # Nothing is counted ahead: the stream's length is not known before it
    # is read.
    assert int(stream.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    for (gx, gy), (wx, wy) in zip(got, want):
        np.testing.assert_array_equal(gx, wx)
        np.testing.assert_array_equal(gy, wy)


@pytest.mark.parametrize("form, replicas", [
    ("dataset", 2), ("input_fn", 2),
    # Each replica trains on the rows it received (1 of 4 holds the last
    # batch's one row: 3 stand-ins).
    ("dataset", 4)])
def test_one_process_trains_like_the_reference(data_dir, cpus, capfd, form,
                                               replicas):
    mirrored = MirroredModel(vs_train.model(), devices=cpus[:replicas],
                             worker_input="shard", virtual_shards=V)
    mirrored.compile(optimizer=vs_train.optimizer(), loss="mse")
    counter = tf.Variable(0, dtype=tf.int64)
    x = vs_train.pipeline(str(data_dir), counter) if form == "dataset" \
        else vs_train.input_fn(str(data_dir), counter)
    if form == "dataset":  # as the reference's input
        assert int(x.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    mirrored.fit(x, epochs=EPOCHS, verbose=0)
    ref, steps = reference_weights()
    assert int(mirrored.optimizer.iterations.numpy()) == steps == 22
    assert max_diff(mirrored.model.get_weights(), ref) < 1e-5
    # One pass per epoch, nothing counted ahead.
    assert int(counter.numpy()) == 90 * EPOCHS
    files = ", 12 of 12 files" if form == "dataset" else ""
    assert capfd.readouterr().err.count(
        "keras-mirror: worker 0 read 90 records (virtual shards 0-5 "
        f"of 6{files}; worker_input='shard').") == EPOCHS


def _launch(data_dir, out, workers, *args, **kwargs):
    return launch_lib.launch(
        [sys.executable, str(WORKER), str(data_dir), str(out), *args], workers,
        timeout=kwargs.pop("timeout", 150), start_timeout=90,
        grace_period=2, **kwargs)


def _shares(workers):
    """Records each worker's virtual shards hold (contiguous blocks)."""
    per_shard = [vs_train.RECORDS[v] + vs_train.RECORDS[v + V]
                 for v in range(V)]
    return [sum(per_shard[v] for v in _virtual_shards.hosted(V, workers, w))
            for w in range(workers)]


def _assert_workers_match_reference(out, workers):
    ref, steps = reference_weights()
    for w in range(workers):
        weights, iterations = load(out, w)
        assert iterations == steps
        gap = max_diff(weights, ref)
        assert gap < 1e-5
    return gap


@pytest.mark.xdist_group("network")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers, form", [(2, "input_fn"), (3, "dataset")])
def test_workers_read_their_shares_and_train_like_one_process(
        data_dir, tmp_path, capsys, workers, form):
    # The 2-worker run is also preempted: SIGTERM to worker 1 after step 3,
    # every worker stops there with the backup written, and the restarted
    # group resumes in every virtual shard.
    preempt = ["--backup", str(tmp_path / "backup"),
               "--sigterm-at-step", "3"] if workers == 2 else []
    code = _launch(data_dir, tmp_path, workers, "--input", form, *preempt,
                   timeout=220)
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    if preempt:
        assert "restarting all workers after the preemption" in err
        assert "StepBackup resumes at epoch 0, step 4 (optimizer step 4)" \
            in out
    shares = _shares(workers)
    assert sum(shares) == 90 and shares == ([44, 46] if workers == 2
                                            else [32, 30, 28])
    for w, share in enumerate(shares):
        info = json.loads((tmp_path / f"info_{w}.json").read_text())
        # Only its own files, once per epoch: nothing is counted ahead (a
        # resumed epoch reads the batches it skips, as one device would).
        assert info["records_parsed"] == share * EPOCHS
        logged = re.findall(rf"\[worker {w}\] keras-mirror: worker {w} read "
                            rf"(\d+) records", err)
        assert logged == [str(share)] * EPOCHS
    gap = _assert_workers_match_reference(tmp_path, workers)
    print(f"{workers} workers, records {shares}: max |w - w_ref| = {gap:.3g}")


@pytest.mark.xdist_group("network")
@pytest.mark.timeout(300)
def test_elastic_three_to_two_workers_resumes_every_shard_exactly(
        data_dir, tmp_path, capsys):
    # Also the launcher's elastic run (once tests/test_elastic.py): worker
    # 2 is SIGKILLed after step 4 on every attempt (a host lost for good);
    # attempt 1 resumes from the step backup and loses worker 2 again;
    # attempt 2 runs on 2 workers, resumes and finishes on the weights of
    # uninterrupted training, no step lost or repeated.
    backup = tmp_path / "backup"
    code = _launch(data_dir, tmp_path, 3, "--backup", str(backup),
                   "--kill-at-step", "4", "--kill-worker", "2",
                   "--kill-always", max_restarts=3, min_workers=2,
                   timeout=280)
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-5000:]
    assert "[worker 2] killing myself after step 4" in out
    assert "[worker 2] killing myself after step 5" in out
    assert ("worker 2 failed in two attempts in a row; continuing with 2 "
            "worker(s) (--min-workers 2).") in err
    assert "StepBackup resumes at epoch 0, step 5 (optimizer step 5)" in out
    infos = [json.loads((tmp_path / f"info_{i}.json").read_text())
             for i in (0, 1)]
    assert [i["num_workers"] for i in infos] == [2, 2]
    # Attempt 2, or later if a port was taken by another process meanwhile
    # (the one restart of margin).
    assert infos[0]["attempt"] == infos[1]["attempt"] >= 2
    # After the shrink: shards 0-2 and 3-5 of the same 6.
    assert re.search(r"\[worker 1\] keras-mirror: worker 1 read 46 "
                     r"records \(virtual shards 3-5 of 6", err)
    gap = _assert_workers_match_reference(tmp_path, 2)
    assert max_diff(load(tmp_path, 0)[0], load(tmp_path, 1)[0]) == 0.0
    print(f"3 -> 3 -> 2 workers: max |w - w_ref| = {gap:.3g}")


def _repeated_reference(data_dir, cpus, steps_per_epoch, epochs):
    """Plain Keras on the first batches of the one-process stream of the
    `repeat()`ed pipeline, `steps_per_epoch` a time (the iterator carries
    on across epochs, as Keras's does)."""
    mirrored = _mirrored(cpus, virtual_shards=V)
    stream = _virtual_shards.fit_dataset(
        mirrored, vs_train.pipeline(str(data_dir)).repeat(), steps_per_epoch)
    batches = list(stream.take(steps_per_epoch * epochs).as_numpy_iterator())
    model = vs_train.model()
    model.compile(optimizer=vs_train.optimizer(), loss="mse")
    ds = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=stream.element_spec)
    model.fit(ds.repeat(), epochs=epochs, steps_per_epoch=steps_per_epoch,
              verbose=0)
    return model.get_weights(), batches


@pytest.mark.timeout(120)
def test_a_repeated_pipeline_with_steps_per_epoch_trains_as_keras(
        data_dir, cpus):
    # It hung: the epoch's length was counted by reading the endless
    # input. Now nothing is counted: 5 steps an epoch, as plain Keras.
    ref, batches = _repeated_reference(data_dir, cpus, 5, 3)
    # The repeat is read past the 90 records of one pass.
    assert sum(len(b[0]) for b in batches) == 12 * 15 > 90
    mirrored = _mirrored(cpus, virtual_shards=V)
    mirrored.fit(vs_train.pipeline(str(data_dir)).repeat(), epochs=3,
                 steps_per_epoch=5, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 15
    assert max_diff(mirrored.model.get_weights(), ref) < 1e-5


@pytest.mark.xdist_group("network")
@pytest.mark.timeout(200)
def test_workers_train_a_repeated_pipeline_as_one_process(
        data_dir, tmp_path, capsys, cpus):
    code = _launch(data_dir, tmp_path, 2, "--repeat-steps", "5",
                   "--epochs", "3", timeout=150)
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    ref, _ = _repeated_reference(data_dir, cpus, 5, 3)
    for w in (0, 1):
        weights, iterations = load(tmp_path, w)
        assert iterations == 15
        assert max_diff(weights, ref) < 1e-5


# -- refusals, before any step ---------------------------------------------

def _files(data_dir):
    return sorted(str(p) for p in data_dir.glob("*.tfrecord"))


@pytest.mark.parametrize("make, message", [
    (lambda d: tf.data.TFRecordDataset(_files(d)[:4]).map(
        vs_train.parse).batch(12),
     "`virtual_shards` must be at most the number of files the pipeline "
     "reads (4): each virtual shard reads whole files. Received: "
     "virtual_shards=6"),
    (lambda d: tf.data.Dataset.from_tensor_slices(
        (np.zeros((20, 6), "float32"), np.zeros((20, 3), "float32"))
    ).batch(12),
     "`worker_input='shard'` shards a `tf.data` pipeline by the files it "
     "reads (`list_files`, `TFRecordDataset`, ...), or by elements where it "
     "holds `.shard(tf.data.experimental.SHARD_HINT, "
     "tf.data.experimental.SHARD_HINT)`; this one has neither. Mark it so, "
     "pass an `input_fn(input_context)`, or read it whole on every worker "
     "with `worker_input='replicate'`. Received: a pipeline without a file "
     "reader or `SHARD_HINT`"),
    (lambda d: tf.data.TFRecordDataset(_files(d)).map(vs_train.parse)
     .shuffle(16).batch(12),
     "`worker_input='shard'` needs a `seed` on every `shuffle` of the "
     "pipeline (and `list_files(..., shuffle=False)` or a seed): each "
     "virtual shard must read its records in the same order on every run "
     "and any number of workers. Received: a pipeline with 1 `shuffle` "
     "without a seed"),
    (lambda d: tf.data.Dataset.list_files(str(d / "*.tfrecord")).interleave(
        tf.data.TFRecordDataset).map(vs_train.parse).batch(12),
     "Received: a pipeline with 1 `shuffle` without a seed"),
    (lambda d: tf.data.TFRecordDataset(_files(d)).map(vs_train.parse)
     .batch(4),
     "`virtual_shards` must be at most the pipeline's batch size (4): each "
     "virtual shard gives every global batch at least one row. Received: "
     "virtual_shards=6"),
    (lambda d: tf.data.TFRecordDataset(_files(d)).map(vs_train.parse),
     "`worker_input='shard'` needs a pipeline that ends with "
     "`batch(global_batch_size)`"),
])
def test_bad_pipelines_are_refused_before_any_step(data_dir, cpus, make,
                                                   message):
    mirrored = _mirrored(cpus, virtual_shards=V)
    # Without a global seed, TensorFlow marks an unseeded `shuffle` with
    # seeds (0, 0); `model()` set one, which would hide it.
    tf.random.set_seed(None)
    with pytest.raises(ValueError, match=re.escape(message)):
        mirrored.fit(make(data_dir), epochs=1, verbose=0)
    assert int(mirrored.optimizer.iterations.numpy()) == 0


@pytest.mark.timeout(120)  # each ran forever, as in plain Keras 3
def test_an_endless_pipeline_or_input_fn_needs_steps_per_epoch(cpus):
    # A SHARD_HINT pipeline is known endless only once sharded; an
    # input_fn's shards only once made.
    x = np.zeros((8, 6), "float32")
    hinted = tf.data.Dataset.from_tensor_slices((x, x[:, :3])).shard(
        tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT
    ).batch(4).repeat()

    def input_fn(context):
        return tf.data.Dataset.from_tensor_slices((x, x[:, :3])).batch(
            2).repeat()

    for name, endless in (("x", hinted), ("input_fn", input_fn)):
        mirrored = _mirrored(cpus, virtual_shards=2)
        with pytest.raises(ValueError, match=re.escape(
                f"`steps_per_epoch` must be given for an endless `{name}` "
                "(a dataset repeated forever, `.repeat()`)")):
            mirrored.fit(endless, verbose=0)
        assert int(mirrored.optimizer.iterations.numpy()) == 0
        mirrored.fit(endless, steps_per_epoch=3, verbose=0)
        assert int(mirrored.optimizer.iterations.numpy()) == 3


def test_seeded_shuffle_and_sharded_elements_are_accepted(cpus):
    mirrored = _mirrored(cpus, virtual_shards=3)
    x = np.arange(20, dtype="float32").reshape(10, 2)
    ds = tf.data.Dataset.from_tensor_slices(x).shard(
        tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT
    ).shuffle(4, seed=1).batch(6)
    stream = _virtual_shards.fit_dataset(mirrored, ds)
    rows = [b.numpy()[:, 0] // 2 for b in stream]
    # Shard v keeps elements v, v + 3, ...; 2 rows of each per batch.
    assert sorted(np.concatenate(rows).tolist()) == list(range(10))
    assert [len(r) for r in rows] == [6, 4]


@pytest.mark.parametrize("args, message", [
    ((2, "shard", 3), "`virtual_shards` must be at least the number of "
     "workers (3): each worker reads one or more whole virtual shards. "
     "Received: virtual_shards=2"),
    ((4, "replicate", 2), "`virtual_shards` needs `worker_input='shard'` "
     "(with 'replicate' every worker reads the whole input). Received: "
     "worker_input='replicate'"),
    ((0, "shard", 1), "`virtual_shards` must be a positive integer. "
     "Received: virtual_shards=0"),
])
def test_virtual_shards_argument_is_checked(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _virtual_shards.check(*args)


def test_launcher_default_and_the_rule_for_uneven_counts(monkeypatch):
    monkeypatch.setenv("KERAS_MIRROR_VIRTUAL_SHARDS", "4")
    assert _virtual_shards.check(None, "shard", 3) == 4
    assert _virtual_shards.check(None, "replicate", 3) is None
    # 4 shards on 3 workers: contiguous blocks of 2, 1, 1.
    assert [list(_virtual_shards.hosted(4, 3, w)) for w in range(3)] == [
        [0, 1], [2], [3]]


def test_backup_of_other_virtual_shards_is_refused(data_dir, cpus,
                                                   tmp_path):
    backup = StepBackup(tmp_path)
    first = _mirrored(cpus, virtual_shards=V)
    first.fit(vs_train.pipeline(str(data_dir)), epochs=1, verbose=0,
              callbacks=[StepBackup(tmp_path, delete_on_train_end=False)])
    with np.load(backup.path) as f:  # written at the epoch's end
        assert int(f["virtual_shards"]) == V
        assert f["shard_positions"].tolist() == [0] * V
    # Inside an epoch: `step` batches into every shard (a shard that has
    # ended is read to its end by skipping them too).
    assert _virtual_shards.backup_arrays(first, 7)[
        "shard_positions"].tolist() == [7] * V
    other = _mirrored(cpus, virtual_shards=3)
    with pytest.raises(errors.StepBackupError, match=re.escape(
            "does not match this run's input: it was written with "
            "virtual_shards=6, this run has virtual_shards=3. Nothing was "
            "restored.")):
        other.fit(vs_train.pipeline(str(data_dir)), epochs=2, verbose=0,
                  callbacks=[backup])
    assert keras.ops.convert_to_numpy(other.optimizer.iterations) == 0
