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
`split.balanced_sizes(V, W)` gives it, reads only those, and the step
all-gathers the workers' rows in worker order, which is virtual-shard order
(`_worker_input.assemble`). One process with the same `V` reads all `V`
shards itself: the single-device reference, and what 2, 3 or, after an
elastic restart, any other number of workers train on.

Before the first step, each worker counts the batches and records of its
shards (one pass over its share) and the workers sum the counts, so that
every worker knows the epoch's length. A `StepBackup` stores `V` and each
virtual shard's position; resuming with another `V` or other input is
refused.
"""

import os
import sys

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror import split
from keras_mirror.distribute import _multi_worker
from keras_mirror.distribute import _pipeline_graph

ENV = _multi_worker.VIRTUAL_SHARDS_ENV
BACKUP_KEYS = ("virtual_shards", "shard_positions")


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


def _dataset_shard(x, facts, num_shards, index):
    policy = tf.data.experimental.AutoShardPolicy
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        policy.HINT if facts.has_hint else policy.FILE)
    shard = _compat.auto_shard(x.with_options(options), num_shards,
                                     index)
    rows = split.balanced_sizes(facts.batch_size, num_shards)[index]
    return shard.rebatch(rows, drop_remainder=facts.drop_remainder)


def _fn_shard(input_fn, num_shards, index):
    shard = input_fn(tf.distribute.InputContext(num_shards, index,
                                                num_shards))
    if not isinstance(shard, tf.data.Dataset):
        raise ValueError(
            "`input_fn` must return a `tf.data.Dataset` for its "
            "`input_context` (one virtual shard). "
            f"Received: input_fn(...) returned {type(shard).__name__}")
    _check_pipeline(_pipeline_graph.inspect(shard), num_shards, True)
    return shard


def _rows(element):
    first = tf.nest.flatten(element)[0]
    return tf.shape(first, out_type=tf.int64)[0]


def _count(shard):
    """(batches, rows) of one pass over a virtual shard."""
    def add(total, element):
        return total + tf.stack([tf.constant(1, tf.int64), _rows(element)])

    try:
        return shard.reduce(tf.zeros(2, tf.int64), add).numpy()
    except tf.errors.InvalidArgumentError as e:
        if "FILE based sharding" not in str(e):
            raise
        raise ValueError(
            "`virtual_shards` must be at most the number of files the "
            "pipeline reads: each virtual shard reads whole files. "
            f"Received: {e.message.split('. ')[0]}") from None


def _sum_over_workers(mirrored, vector):
    """Each worker's `vector` summed over the workers (cluster only)."""
    if mirrored.num_workers < 2:
        return vector
    strategy = mirrored.strategy
    first = mirrored.local_replica_ids[0]
    local = tf.constant(vector, tf.int64)

    def value(ctx):
        keep = tf.cast(tf.equal(ctx.replica_id_in_sync_group, first),
                       tf.int64)
        return local * keep

    with strategy.scope():
        per_replica = strategy.experimental_distribute_values_from_function(
            value)
        return strategy.reduce("SUM", per_replica, axis=None).numpy()


def _empty(spec):
    def zeros(s):
        shape = [0] + [0 if d is None else d for d in s.shape[1:]]
        return tf.zeros(shape, s.dtype)

    return tf.data.Dataset.from_tensors(tf.nest.map_structure(zeros, spec))


def _concat(*parts):
    return tf.nest.map_structure(lambda *t: tf.concat(t, axis=0), *parts)


def _stream(shards, counts, steps, message):
    """One element per step: this worker's shards' batches, concatenated."""
    padded = tuple(
        shard.concatenate(_empty(shard.element_spec).repeat(
            steps - int(count[0])))
        for shard, count in zip(shards, counts))
    stream = tf.data.Dataset.zip(padded).map(_concat)

    def read(total, element):
        total = total + _rows(element)
        return total, (total, element)

    def log(index, pair):
        total, element = pair

        def say():
            tf.print(tf.strings.format(message, total),
                     output_stream=sys.stderr)
            return tf.constant(0)

        with tf.control_dependencies([tf.cond(
                tf.equal(index, steps - 1), say, lambda: tf.constant(0))]):
            return tf.nest.map_structure(tf.identity, element)

    stream = stream.scan(tf.constant(0, tf.int64), read).enumerate().map(log)
    return stream.apply(tf.data.experimental.assert_cardinality(steps))


def fit_dataset(mirrored, x):
    """The dataset `fit` reads for `x` on this worker (see module doc)."""
    num_shards = mirrored.virtual_shards or mirrored.num_workers
    from_fn = is_input_fn(x)
    facts = None
    if not from_fn:
        facts = _pipeline_graph.inspect(x)
        _check_pipeline(facts, num_shards, False)
    position = mirrored.local_replica_ids[0] // len(mirrored.devices)
    mine = hosted(num_shards, mirrored.num_workers, position)
    shards = [_fn_shard(x, num_shards, v) if from_fn else
              _dataset_shard(x, facts, num_shards, v) for v in mine]
    counts = [_count(shard) for shard in shards]
    everyone = [[0, 0]] * num_shards
    for v, count in zip(mine, counts):
        everyone[v] = list(count)
    everyone = _sum_over_workers(mirrored, everyone)
    lengths = [int(c[0]) for c in everyone]
    total = sum(int(c[1]) for c in everyone)
    steps = max(lengths)
    files = "" if facts is None or facts.files is None else (
        f", {len(file_shares(facts.files, num_shards, mine))} of "
        f"{len(facts.files)} files")
    message = (f"keras-mirror: worker {position} read {{}} of {total} "
               f"records (virtual shards {mine.start}-{mine.stop - 1} of "
               f"{num_shards}{files}; worker_input='shard').")
    stream = _stream(shards, counts, steps, message.replace("%", "%%"))
    forget(mirrored, {"num_shards": num_shards, "lengths": lengths,
                      "hosted": mine, "dataset": stream})
    return stream


def forget(mirrored, state=None):
    """Sets (or clears) the virtual shards of this `fit`'s input."""
    object.__setattr__(mirrored, "_virtual_state", state)


def file_shares(files, num_shards, shards):
    """The files the virtual shards `shards` of `num_shards` read."""
    return [f for v in shards for f in files[v::num_shards]]


# -- StepBackup ------------------------------------------------------------

def _positions(state, step):
    return [min(step, length) for length in state["lengths"]]


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
    """
    state = getattr(mirrored, "_virtual_state", None)
    saved = int(arrays["virtual_shards"]) if "virtual_shards" in arrays \
        else None
    now = None if state is None else state["num_shards"]
    if saved == now and (state is None or list(
            arrays["shard_positions"]) == _positions(state, step)):
        return
    detail = (f"it was written with virtual_shards={saved}, this run has "
              f"virtual_shards={now}") if saved != now else (
        "its virtual shards' positions "
        f"{list(map(int, arrays['shard_positions']))} do not fit this "
        f"input's shards (batches per shard {state['lengths']}): the "
        "input changed")
    raise errors.StepBackupError(
        f"The step backup {path!r} does not match this run's input: "
        f"{detail}. Nothing was restored. Resume with the same "
        "`virtual_shards` and input (a run's global batches depend on "
        f"them), or delete the backup. Received: virtual_shards={now}")
