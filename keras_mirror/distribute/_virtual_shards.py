"""Virtual shards: a `tf.data` input read in shares, the same on any cluster.

With `worker_input="shard"`, `fit` given a `tf.data.Dataset` (or an
`input_fn(input_context)`) cuts it into `V = virtual_shards` shards fixed
for the run, whatever the number of workers:

- a pipeline that reads files (`list_files(..., shuffle=False)` or a list
  of files, `TFRecordDataset` / `interleave`, `map`, `batch(B)`): virtual
  shard `v` reads files `v, v + V, v + 2V, ...` (TensorFlow's FILE
  auto-sharding, for `V` shards) and batches its records `b_v` at a time,
  `b_v = split.balanced_sizes(B, V)[v]`;
- a pipeline without files that holds
  `.shard(tf.data.experimental.SHARD_HINT, tf.data.experimental.SHARD_HINT)`:
  shard `v` keeps elements `v, v + V, ...` at that point;
- `input_fn(input_context)`: shard `v` is
  `input_fn(tf.distribute.InputContext(V, v, V))`, batched by the function
  (`input_context.get_per_replica_batch_size(B)`).

Global batch `k` is batch `k` of every virtual shard, concatenated in
virtual-shard order (a shard that has run out gives no rows); an epoch
ends when the longest shard does. Nothing here depends on the number of
workers: worker `w` of `W` hosts the contiguous block of shards
`split.balanced_sizes(V, W)` gives it, reads only those, and its replicas
train on those rows as they are (`steps/_own_rows.py`): replicas in worker
order are in virtual-shard order, so the global batch is the same
(`_worker_input.assemble`). One process with the same `V` reads all `V`
shards itself: the single-device reference, and what 2, 3 or, after an
elastic restart, any other number of workers train on.

Nothing is read ahead: each worker's stream ends with its longest shard,
and on a cluster the strategy's distributed iterator agrees at every step
whether any worker still has rows (`_worker_input.distributed`), so the
epoch ends on every worker at the same step and each worker reads its
share once per epoch. A `StepBackup` stores `V` and each virtual shard's
position; resuming with another `V` is refused.
"""

import os
import sys

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror import split
from keras_mirror.distribute import _input_fn
from keras_mirror.distribute import _multi_worker
from keras_mirror.distribute import _pipeline_graph
from keras_mirror.distribute import _rows

ENV = _multi_worker.VIRTUAL_SHARDS_ENV


def check(virtual_shards, worker_input, num_workers):
    """The number of virtual shards to use (None: not given, not set)."""
    if virtual_shards is None and worker_input == "shard" and \
            os.environ.get(ENV):
        text = os.environ[ENV]
        if not text.isdigit() or int(text) < 1:
            raise ValueError(
                f"`{ENV}` must be a positive integer (the number of "
                f"virtual shards). Received: {ENV}={text!r}")
        virtual_shards = int(text)
    if virtual_shards is None:
        return None
    if isinstance(virtual_shards, bool) or not isinstance(
            virtual_shards, int) or virtual_shards < 1:
        raise ValueError(
            "`virtual_shards` must be a positive integer. "
            f"Received: virtual_shards={virtual_shards!r}")
    if worker_input != "shard":
        raise ValueError(
            "`virtual_shards` needs `worker_input='shard'` (with "
            "'replicate' every worker reads the whole input). "
            f"Received: worker_input={worker_input!r}")
    if virtual_shards < num_workers:
        raise ValueError(
            "`virtual_shards` must be at least the number of workers "
            f"({num_workers}): each worker reads one or more whole virtual "
            f"shards. Received: virtual_shards={virtual_shards}")
    return virtual_shards


def hosted(num_shards, num_workers, position):
    """The virtual shards worker `position` reads: a contiguous block."""
    sizes = split.balanced_sizes(num_shards, num_workers)
    start = sum(sizes[:position])
    return range(start, start + sizes[position])


def is_input_fn(x):
    return callable(x) and not isinstance(
        x, (tf.data.Dataset, keras.utils.PyDataset))


def applies(mirrored, x):
    return mirrored.worker_input == "shard" and (
        isinstance(x, tf.data.Dataset) or is_input_fn(x))


def _refuse(problem, received):
    raise ValueError(f"`worker_input='shard'` {problem} Received: {received}")


def _check_pipeline(facts, num_shards, from_fn):
    if facts.unseeded_shuffles:
        _refuse("needs a `seed` on every `shuffle` of the pipeline (and "
                "`list_files(..., shuffle=False)` or a seed): each virtual "
                "shard must read its records in the same order on every "
                "run and any number of workers.",
                f"a pipeline with {len(facts.unseeded_shuffles)} "
                "`shuffle` without a seed")
    if from_fn:
        return
    if not facts.has_reader and not facts.has_hint:
        _refuse("shards a `tf.data` pipeline by the files it reads "
                "(`list_files`, `TFRecordDataset`, ...), or by elements "
                "where it holds `.shard(tf.data.experimental.SHARD_HINT, "
                "tf.data.experimental.SHARD_HINT)`; this one has neither. "
                "Mark it so, pass an `input_fn(input_context)`, or read it "
                "whole on every worker with `worker_input='replicate'`.",
                "a pipeline without a file reader or `SHARD_HINT`")
    if facts.batch_size is None:
        _refuse("needs a pipeline that ends with `batch(global_batch_size)`"
                " (optionally then `map` or `prefetch`): the global batch "
                "is cut between the virtual shards.",
                "a pipeline without a final `batch`")
    if facts.files is not None and not facts.has_hint and \
            len(facts.files) < num_shards:
        raise ValueError(
            "`virtual_shards` must be at most the number of files the "
            f"pipeline reads ({len(facts.files)}): each virtual shard "
            f"reads whole files. Received: virtual_shards={num_shards}")
    if facts.batch_size < num_shards:
        raise ValueError(
            "`virtual_shards` must be at most the pipeline's batch size "
            f"({facts.batch_size}): each virtual shard gives every global "
            f"batch at least one row. Received: virtual_shards={num_shards}")


def _dataset_shard(x, facts, num_shards, index, steps_per_epoch):
    policy = tf.data.experimental.AutoShardPolicy
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        policy.HINT if facts.has_hint else policy.FILE)
    shard = _compat.auto_shard(x.with_options(options), num_shards,
                                     index)
    # Known endless here (a SHARD_HINT pipeline is not, before sharding).
    _rows.refuse_endless("x", shard, "steps_per_epoch", steps_per_epoch)
    rows = split.balanced_sizes(facts.batch_size, num_shards)[index]
    return shard.rebatch(rows, drop_remainder=facts.drop_remainder)


def _fn_dataset(input_fn, num_shards, index):
    shard = input_fn(tf.distribute.InputContext(num_shards, index,
                                                num_shards))
    if not isinstance(shard, tf.data.Dataset):
        raise ValueError(
            "`input_fn` must return a `tf.data.Dataset` for its "
            "`input_context` (one virtual shard). "
            f"Received: input_fn(...) returned {type(shard).__name__}")
    return shard


def _fn_shards(input_fn, num_shards, mine, steps_per_epoch):
    """This worker's shards of `input_fn`, checked against every shard
    (the other workers' shards are made, never read), so that every worker
    refuses a mismatch, or an endless shard without `steps_per_epoch`,
    before any step."""
    _input_fn.check_signature(input_fn)
    shards = {v: _fn_dataset(input_fn, num_shards, v) for v in mine}
    every = [shards[v] if v in shards else _fn_dataset(
        input_fn, num_shards, v) for v in range(num_shards)]
    _input_fn.check_specs([s.element_spec for s in every], "input_fn")
    _rows.refuse_endless("input_fn", every, "steps_per_epoch",
                             steps_per_epoch)
    for shard in shards.values():
        _check_pipeline(_pipeline_graph.inspect(shard), num_shards, True)
    return [shards[v] for v in mine]


def _element_rows(element):
    first = tf.nest.flatten(element)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def _empty(spec):
    def zeros(s):
        shape = [0] + [0 if d is None else d for d in s.shape[1:]]
        return tf.zeros(shape, s.dtype)

    return tf.data.Dataset.from_tensors(tf.nest.map_structure(zeros, spec))


def _concat(*parts):
    return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *parts)


def _longest(shards):
    """Batch `k` of every shard, concatenated, until the longest ends.

    A shard that has run out gives no rows (an empty batch); nothing is
    counted ahead: the stream ends when no shard has a batch left. An
    endless input (`repeat()`) gives an endless stream.
    """
    def flagged(shard):
        return shard.map(lambda *e: (True, e)).concatenate(
            _empty(shard.element_spec).map(lambda *e: (False, e)).repeat())

    zipped = tf.data.Dataset.zip(tuple(flagged(s) for s in shards))
    zipped = zipped.take_while(
        lambda *pairs: tf.reduce_any(tf.stack([p[0] for p in pairs])))
    return zipped.map(lambda *pairs: _unwrap(_concat(*[p[1] for p in pairs])))


def _unwrap(element):
    return element[0] if isinstance(element, tuple) and len(element) == 1 \
        else element


def _logged(stream, message):
    """`stream`, printing `message` with the rows it gave when it ends.

    The rows are summed as the stream is read (a variable the pipeline
    updates), so nothing is read for the message.
    """
    read = tf.Variable(0, dtype=tf.int64, trainable=False)

    def count(*element):
        read.assign_add(_element_rows(element))
        return _unwrap(element)

    def say(_):
        tf.print(tf.strings.format(message, read.read_value()),
                 output_stream=sys.stderr)
        with tf.control_dependencies([read.assign(0)]):
            return tf.constant(False)

    tail = tf.data.Dataset.range(1).map(say).filter(lambda never: never)
    return stream.map(count).concatenate(tail.map(
        lambda _: tf.nest.map_structure(
            lambda s: tf.zeros([0] + [0 if d is None else d
                                      for d in s.shape[1:]], s.dtype),
            stream.element_spec)))


def fit_input(mirrored, x, y, batch_size, steps_per_epoch=None):
    """`fit`'s `x`: this worker's virtual shards of a dataset or input_fn.

    Unchanged unless `worker_input="shard"` and `x` is a `tf.data.Dataset`
    or an `input_fn`; then a dataset of this worker's rows of each global
    batch (all of them in one process), see `fit_dataset`.
    """
    if not applies(mirrored, x):
        forget(mirrored)
        return x
    if mirrored.batch_mode != "global":
        _refuse("needs `batch='global'`.", f"batch={mirrored.batch_mode!r}")
    if y is not None or batch_size is not None:
        _refuse("reads `x` as a dataset or `input_fn` of whole batches: "
                "pass neither `y` nor `batch_size`.",
                f"y={type(y).__name__}, batch_size={batch_size!r}")
    return fit_dataset(mirrored, x, steps_per_epoch)


def fit_dataset(mirrored, x, steps_per_epoch=None):
    """The dataset `fit` reads for `x` on this worker (see module doc).

    Each element is this worker's rows of one global batch (its hosted
    shards' batches, in shard order); it ends when its longest shard
    does. The input is read once per epoch: nothing is counted ahead. On
    a cluster the workers agree on the epoch's end as they read
    (`distributed`).
    """
    num_shards = mirrored.virtual_shards or mirrored.num_workers
    from_fn = is_input_fn(x)
    facts = None
    if not from_fn:
        facts = _pipeline_graph.inspect(x)
        _check_pipeline(facts, num_shards, False)
    position = mirrored.local_replica_ids[0] // len(mirrored.devices)
    mine = hosted(num_shards, mirrored.num_workers, position)
    if from_fn:
        shards = _fn_shards(x, num_shards, mine, steps_per_epoch)
    else:
        shards = [_dataset_shard(x, facts, num_shards, v, steps_per_epoch)
                  for v in mine]
        _input_fn.check_specs([s.element_spec for s in shards], "x")
    files = "" if facts is None or facts.files is None else (
        f", {len(file_shares(facts.files, num_shards, mine))} of "
        f"{len(facts.files)} files")
    message = (f"keras-mirror: worker {position} read {{}} records "
               f"(virtual shards {mine.start}-{mine.stop - 1} of "
               f"{num_shards}{files}; worker_input='shard').")
    stream = _logged(_longest(shards), message.replace("%", "%%"))
    forget(mirrored, {"num_shards": num_shards, "hosted": mine,
                      "dataset": stream})
    return stream


def forget(mirrored, state=None):
    """Sets (or clears) the virtual shards of this `fit`'s input."""
    object.__setattr__(mirrored, "_virtual_state", state)


def file_shares(files, num_shards, shards):
    """The files the virtual shards `shards` of `num_shards` read."""
    return [f for v in shards for f in files[v::num_shards]]


# -- StepBackup ------------------------------------------------------------

# The fields `backup_arrays` writes: (shape, dtype, what they hold); a
# shape's None is any length, "integer" any integer dtype.
BACKUP_FIELDS = {
    "virtual_shards": ((), "integer", "the number of virtual shards"),
    "shard_positions": ((None,), "integer",
                        "the batches read of each virtual shard"),
}


def _positions(state, step):
    """Each shard's position: `step` batches (a shard that has ended is
    read to its end, which skipping `step` batches of it also gives)."""
    return [step] * state["num_shards"]


def backup_arrays(mirrored, step):
    """Arrays a `StepBackup` stores after `step` batches of an epoch."""
    state = getattr(mirrored, "_virtual_state", None)
    if state is None:
        return {}
    return {"virtual_shards": tf.constant(state["num_shards"]).numpy(),
            "shard_positions": tf.constant(_positions(state, step),
                                           tf.int64).numpy()}


def check_backup(mirrored, arrays, path, step):
    """Raises `StepBackupError` unless the backup's shards are this run's.

    `arrays` holds both fields of `BACKUP_FIELDS` or neither; each of the
    shape and dtype it names (`StepBackup` checks them as it reads).
    """
    state = getattr(mirrored, "_virtual_state", None)
    now = None if state is None else state["num_shards"]
    saved = _saved_shards(arrays, path, now)
    if saved == now and (state is None or arrays[
            "shard_positions"].tolist() == _positions(state, step)):
        return
    detail = (f"it was written with virtual_shards={saved}, this run has "
              f"virtual_shards={now}") if saved != now else (
        "its virtual shards' positions "
        f"{arrays['shard_positions'].tolist()} are not "
        f"{step} batches into each of this input's {state['num_shards']} "
        "shards")
    raise _mismatch(path, detail, now)


def _saved_shards(arrays, path, now):
    """The backup's `virtual_shards` (None if it has none), checked."""
    if not any(k in arrays for k in BACKUP_FIELDS):
        return None
    for key, (shape, _, what) in BACKUP_FIELDS.items():
        if key not in arrays:
            raise _mismatch(path, f"field {key!r} ({what}) is missing",
                            now)
        value = arrays[key]
        if value.dtype.kind not in "iu" or value.ndim != len(shape):
            kind = "one integer" if not shape else "a vector of integers"
            raise _mismatch(
                path, f"field {key!r} ({what}) must be {kind}. Received: "
                f"{key} of shape {value.shape} and dtype {value.dtype}", now)
    saved, positions = (arrays[k] for k in BACKUP_FIELDS)
    if int(saved) < 1 or positions.shape != (int(saved),) or \
            bool((positions < 0).any()):
        raise _mismatch(
            path, "fields 'virtual_shards' and 'shard_positions' must be "
            "a positive count and as many positions of 0 or more. "
            f"Received: virtual_shards={int(saved)}, shard_positions="
            f"{positions.tolist()[:8]}", now)
    return int(saved)


def _mismatch(path, detail, now):
    return errors.StepBackupError(
        f"The step backup {path!r} does not match this run's input: "
        f"{detail}. Nothing was restored. Resume with the same "
        "`virtual_shards` and input (a run's global batches depend on "
        f"them), or delete the backup. Received: virtual_shards={now}")
