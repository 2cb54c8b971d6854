"""`worker_input="shard"`: each worker reads only its rows of the input.

With `worker_input="replicate"` every worker reads every global batch and
keeps its replicas' rows. With `"shard"`, `fit` given arrays (NumPy
arrays, memory-mapped `.npy` files included) makes each worker read only
the rows its own replicas train on: for global batch `k` (rows
`[k*B, k*B + b_k)`), the split plan `split_plan(b_k)` gives the replicas
of worker `w` one contiguous segment, and worker `w` reads exactly that
segment. Inside the step the workers' segments are all-gathered, in worker
order, into the global batch, so the step, the split plan and exactness
are those of `"replicate"`: each worker reads 1/W of the data (its I/O and
preprocessing), while the batch itself still crosses the network once per
step. Each worker prints the rows it read per epoch.

A `tf.data.Dataset` or an `input_fn(input_context)` is read in virtual
shards (`_virtual_shards`): `_virtual_shards.fit_input` turns it into this
worker's stream at the start of `fit`, and the same all-gather assembles
the global batch.

`shard_fit_input` is the last stage of the pass over `fit`'s input
(`wrapper/_fit_input`); `fit_reader` then hands Keras's `fit` this
worker's rows, distributed by the strategy (`distributed`).

Supported: `batch="global"`, arrays with `shuffle=False` (the order must be
the same on every worker and on a resumed run), no `validation_split`
(pass `validation_data`, which every worker reads whole). Evaluation and
prediction read their input whole.
"""

import math
import sys

import tensorflow as tf

from keras_mirror import split
from keras_mirror.distribute import _rows
from keras_mirror.distribute import _virtual_shards

_MARK = "keras_mirror_worker_rows"


def _refuse(problem, received):
    raise ValueError(
        f"`worker_input='shard'` {problem} Received: {received}")


def _check(mirrored, x, y, kwargs):
    if mirrored.batch_mode != "global":
        _refuse("needs `batch='global'`.",
                f"batch={mirrored.batch_mode!r}")
    if not _rows.is_array(x):
        _refuse("reads rows of arrays (NumPy arrays or memory-mapped "
                "`.npy` files) or virtual shards of a `tf.data.Dataset` "
                "or an `input_fn(input_context)`; other inputs are read "
                "whole by every worker with `worker_input='replicate'`.",
                f"x={type(x).__name__}")
    if kwargs.get("shuffle", True):
        _refuse("needs `shuffle=False`: every worker must see the rows in "
                "the same order.", f"shuffle={kwargs.get('shuffle', True)}")
    if kwargs.get("validation_split"):
        _refuse("does not support `validation_split`; pass "
                "`validation_data`.",
                f"validation_split={kwargs['validation_split']}")


def segments(mirrored, rows, batch_size):
    """`(start, stop)` of this worker's rows in each global batch."""
    first = mirrored.local_replica_ids[0]
    n_local = len(mirrored.local_replica_ids)
    out = []
    for k in range(math.ceil(rows / batch_size)):
        size = min(batch_size, rows - k * batch_size)
        plan = split.balanced_sizes(size, mirrored.num_replicas)
        start = k * batch_size + sum(plan[:first])
        out.append((start, start + sum(plan[first:first + n_local])))
    return out


def _is_virtual(mirrored, x):
    state = getattr(mirrored, "_virtual_state", None)
    return state is not None and x is state["dataset"]


def shard_fit_input(mirrored, x, y, batch_size, kwargs):
    """`fit`'s `(x, y, batch_size, kwargs)`, sharded between workers.

    Unchanged unless `worker_input="shard"` on a cluster; else a dataset
    of this worker's rows of each global batch (see the module docstring).
    """
    if _is_virtual(mirrored, x):  # in one process too: the one path
        return x.map(lambda *p: {_MARK: p}), y, batch_size, kwargs
    if mirrored.worker_input != "shard" or mirrored.num_workers < 2:
        return x, y, batch_size, kwargs
    _check(mirrored, x, y, kwargs)
    kwargs = dict(kwargs)
    sw = kwargs.pop("sample_weight", None)
    kwargs.pop("shuffle", None)
    parts = tuple(p for p in (x, y, sw) if p is not None)
    rows = _rows.num_rows(x)
    batch_size = batch_size or 32
    bounds = segments(mirrored, rows, batch_size)
    position = mirrored.local_replica_ids[0] // len(mirrored.devices)
    counter = {"epoch": 0}

    def read():
        counter["epoch"] += 1
        read_rows = 0
        for start, stop in bounds:
            read_rows += stop - start
            yield tf.nest.map_structure(lambda t: t[start:stop], parts)
        print(f"keras-mirror: worker {position} read {read_rows} of {rows} "
              f"rows (epoch {counter['epoch']}, worker_input='shard').",
              file=sys.stderr, flush=True)

    signature = tf.nest.map_structure(
        lambda t: tf.TensorSpec((None,) + tuple(t.shape[1:]),
                                tf.as_dtype(t.dtype)), parts)
    dataset = tf.data.Dataset.from_generator(read, output_signature=signature)
    dataset = dataset.map(lambda *p: {_MARK: p})
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(
        len(bounds)))
    return dataset, None, None, kwargs


def _marked(x):
    spec = getattr(x, "element_spec", None)
    return isinstance(x, tf.data.Dataset) and isinstance(spec, dict) and \
        set(spec) == {_MARK}


def _pieces(n_local):
    """An element of this worker's rows as `n_local` consecutive elements,
    one per local replica, in order (balanced, contiguous)."""
    def split(element):
        leaves = tf.nest.flatten(element)
        rows = tf.shape(leaves[0], out_type=tf.int64)[0]
        base, extra = rows // n_local, rows % n_local

        def piece(i):
            start = i * base + tf.minimum(i, extra)
            size = base + tf.cast(i < extra, tf.int64)
            return tf.nest.map_structure(
                lambda t: t[start:start + size], element)

        return tf.data.Dataset.range(n_local).map(piece)

    return split


def fit_reader(mirrored, keras_fit):
    """Keras's `fit` (`keras_fit`) on `x` as the strategy distributes it.

    Returned to `MirroredModel.fit`, which calls it directly or, resuming
    from a `StepBackup`, once per segment: on a cluster, this worker's rows
    become the strategy's distributed dataset only then, after a resume
    skipped some.
    """
    def fit(x, *args, **kwargs):
        return keras_fit(distributed(mirrored, x), *args, **kwargs)

    return fit


def distributed(mirrored, x):
    """Keras's `x`: this worker's rows of its virtual shards, read by the
    strategy (in one process too: the code a cluster runs).

    Unchanged unless `x` holds this worker's rows (`shard_fit_input`).
    Then `tf.distribute`'s own distributed dataset of it: each local
    replica receives its consecutive part of the worker's rows, and when
    some workers have run out and others have not, the strategy's
    iterator agrees on it across the workers at every step (an all-reduce
    of the number of replicas with data, TensorFlow's partial-batch
    handling): a worker out of rows gives empty batches until every
    worker is, and then the epoch ends on all of them at the same step.
    Nothing is counted ahead, so the input is read once per epoch.
    """
    if not _marked(x) or int(x.cardinality()) >= 0:
        # Arrays' rows: every worker has an element for each of the steps
        # Keras counts, so nothing needs agreeing.
        return x
    per_replica = x.flat_map(_pieces(len(mirrored.local_replica_ids)))
    return mirrored.strategy.distribute_datasets_from_function(
        lambda _: per_replica)


def local_rows(data):
    """This worker's rows of a distributed element, concatenated (its
    local replicas' parts in order): what the loss-term probe reads."""
    def join(value):
        if isinstance(value, tf.distribute.DistributedValues):
            parts = value.values
            return tf.concat(parts, axis=0) if len(parts) > 1 else parts[0]
        return value

    return tf.nest.map_structure(join, data)


def _dense(data):
    return all(isinstance(t, tf.distribute.DistributedValues) and all(
        isinstance(v, tf.Tensor) for v in t.values)
        for t in tf.nest.flatten(data) if t is not None)


def assemble(mirrored, data):
    """The step's input from every worker's rows (a no-op otherwise).

    Runs in the training step. A distributed element (`distributed`) of
    dense tensors stays as it is: each replica trains on the rows it
    received, and only the row counts and what the metrics need cross the
    network (`ReplicaSteps._shards_of`). Otherwise the strategy's
    all-gather concatenates every replica's rows in global replica order,
    which is worker order: the global batch, as every worker would have
    read it.
    """
    if not isinstance(data, dict) or set(data) != {_MARK}:
        return data
    strategy = mirrored.strategy
    rows = data[_MARK]
    if _rows.is_per_replica(rows) and _dense(rows):
        return rows
    if not _rows.is_per_replica(rows):
        # A worker's rows in one element (arrays): its first local
        # replica holds them, the others none.
        first = mirrored.local_replica_ids[0]

        def local(ctx):
            keep = tf.cast(tf.equal(ctx.replica_id_in_sync_group, first),
                           tf.int32)
            return tf.nest.map_structure(
                lambda t: t[:tf.shape(t)[0] * keep], rows)

        rows = strategy.experimental_distribute_values_from_function(local)
    with strategy.scope():
        gathered = tf.nest.map_structure(
            lambda v: strategy.gather(v, axis=0), rows)
    return tuple(gathered)


def check_virtual_shards(virtual_shards, worker_input, spec):
    """`MirroredModel`'s `virtual_shards`, checked (see `_virtual_shards`)."""
    return _virtual_shards.check(virtual_shards, worker_input,
                                 1 if spec is None else spec.num_workers)
