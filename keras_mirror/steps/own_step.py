"""Models with their own `train_step`, `test_step` or `predict_step`.

A model that overrides `train_step` (keras.io DCGAN / WGAN-GP style: its own
`compile(d_optimizer=..., g_optimizer=..., loss_fn=...)`, a step that calls
`self.d_optimizer.apply_gradients(...)`; the Keras guide's step that calls
`self.compute_loss` and updates `self.metrics`) runs unchanged under
`MirroredModel`, on the user's own object:

- Each step splits the global batch by the split plan and runs the user's
  step once per replica, on its shard, in replica context. Keras's division
  of losses by the replica count is switched off meanwhile, so the step
  computes exactly what one device would on those rows; `keras.random`
  draws are one device's rows (`_random`); metric updates are weighted as
  one device's (`_metric_weights`).
- When the step applies gradients (`optimizer.apply` or
  `apply_gradients`), each gradient is multiplied by the replica's share
  `b_r / B` (0 on an empty shard, never NaN) and summed over replicas,
  once, before the optimizer's own `apply` runs (`applied_globally`). For a
  loss that is a mean over the batch, the sum is the gradient one device
  computes on the whole global batch, and the optimizer treats it as one
  device would, whatever the step did between the loss and `apply`: a
  `LossScaleOptimizer`'s `scale_loss` and unscaling, `loss_scale_factor`,
  clipping, weight decay, gradient accumulation (of the global gradient),
  EMA, several optimizers.
- The scalars the step returns come back as per-replica vectors
  `replica_<key>` and globally: a key naming one of the model's metrics
  reports the metric (its state is the global batch's), any other scalar
  the share-weighted sum (exact for per-batch means).

`train_step`, `test_step` and `predict_step` overrides run under the same
runner as the built-in step, on `tf.distribute`: the replicas wait for each
other (a GAN's generator step reads the discriminator that every replica's
gradients just updated).

A non-scalar target of `tape.gradient` with a row per example (a per-pixel
loss) is differentiated as the batch sum it is (`_tape`). What differs from
one device: a scalar loss the user's own step computes as a batch *sum* by
hand (weighted as a mean).
"""

import contextlib

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import allreduce
from keras_mirror import split
from keras_mirror.distribute import _homes
from keras_mirror.distribute import _rows
from keras_mirror.replica_context import ReplicaContext
from keras_mirror.replica_context import activate
from keras_mirror.replica_context import active
from keras_mirror.steps import _metric_weights
from keras_mirror.steps import _mixing
from keras_mirror.steps import _one_update
from keras_mirror.steps import _scope
from keras_mirror.steps import _stand_in
from keras_mirror.steps import _tape

PREFIX = "replica_"


def overrides(model, method):
    """True when `model`'s class overrides `keras.Model.<method>`."""
    return getattr(type(model), method) is not getattr(keras.Model, method)


def has_custom_step(model):
    """True when `model`'s class overrides `keras.Model.train_step`."""
    return overrides(model, "train_step")


def setup(model):
    """Marks a custom-step model built when its sub-models hold weights.

    Models such as a GAN have no `call`, so they are never "built" by a
    forward pass, although their sub-models hold all the weights (Keras
    asks users to mark them built under a strategy). Returns whether the
    model has its own `train_step`.
    """
    if not has_custom_step(model):
        return False
    if not model.built and model.weights:
        model.built = True
    return True


def applied_globally(original, strategy):
    """The replacement for an own step's optimizer's `apply`.

    In a replica step: each gradient weighted by the replica's share and
    all-reduced, once, here at the door; then the optimizer's own `apply`
    on that global gradient, writing the replica's copies of the variables
    in place (`_one_update.on_copies`). Everything the optimizer does after
    that (a `LossScaleOptimizer`'s finiteness check and unscaling,
    clipping, weight decay, gradient accumulation, EMA) sees the global
    gradient, as on one device, whatever the user's step did to the
    gradients before (`scale_loss`, their own clipping). An `apply` within
    it (a `LossScaleOptimizer`'s inner optimizer's) is the optimizer's own.
    Outside a replica step, the optimizer's own.
    """

    def apply(grads, trainable_variables=None):
        ctx = active()
        if ctx is None or ctx._applying:
            return original(grads, trainable_variables)
        grads = list(grads)
        if trainable_variables is not None:  # maybe an iterator
            trainable_variables = list(trainable_variables)
        weighted = [None if g is None else ctx.weight(g) for g in grads]
        reduced = allreduce.all_reduce_sum(weighted, ctx._options,
                                           ctx._gradient_dtype)
        optimizer = original.__self__
        variables = _homes.unique(
            list(trainable_variables or [])
            + _compat.optimizer_trainables(optimizer)
            + list(optimizer.variables))
        copies = _one_update.replica_copies(strategy, variables)
        ctx._applying = True
        try:
            with _one_update.on_copies(optimizer, variables, copies):
                return original(reduced, trainable_variables)
        finally:
            ctx._applying = False

    return apply


def reduced_already(original):
    """The optimizer's all-reduce hook in a replica step: the identity
    (`applied_globally` has reduced, once)."""

    def all_reduce(grads_and_vars):
        if active() is None:
            return original(grads_and_vars)
        return list(grads_and_vars)

    return all_reduce


_GLOBAL = ("an own step's gradients are weighted by the replica's share and "
           "all-reduced once, when applied, so that the optimizer (loss "
           "scaling, clipping, accumulation) sees the global gradient")


@contextlib.contextmanager
def optimizer_hooks(optimizer, strategy):
    """Within the block, the replica all-reduce of a model's own-step
    optimizer (entered around the replicas' step, `_run`): at its `apply`
    (and a `LossScaleOptimizer`'s inner one's), with the optimizer's own
    all-reduce off. Outside a replica step the hooks call the optimizer's
    own.
    """
    with contextlib.ExitStack() as stack:
        for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if opt is None:
                continue
            stack.enter_context(_compat.replaced_method(
                opt, "apply", lambda original: applied_globally(
                    original, strategy),
                "apply an own step's gradients", _GLOBAL,
                owner="keras.optimizers.Optimizer"))
        stack.enter_context(_compat.replace_optimizer_allreduce(
            optimizer, reduced_already, _GLOBAL))
        yield


@contextlib.contextmanager
def _hooks(mirrored):
    """`optimizer_hooks` of each of the wrapped model's optimizers."""
    with contextlib.ExitStack() as stack:
        for optimizer in _homes.optimizers_of(mirrored._inner):
            stack.enter_context(
                optimizer_hooks(optimizer, mirrored._strategy))
        yield


# -- the steps ---------------------------------------------------------------


def train_step(mirrored, data):
    """Runs the wrapped model's `train_step` on every replica's shard."""
    logs = _run(mirrored, data, "train_step")
    mirrored._sync_state()
    mirrored.optimizer.iterations.assign_add(1)
    return logs


def test_step(mirrored, data):
    """Runs the wrapped model's `test_step` on every replica's shard."""
    return _run(mirrored, data, "test_step")


def predict_step(mirrored, data):
    """Runs the wrapped model's `predict_step`; rows in replica order."""
    return _run(mirrored, data, "predict_step")


def _split(data):
    flat = tf.nest.flatten(data)
    present = [i for i, t in enumerate(flat) if t is not None]
    tensors = [tf.convert_to_tensor(flat[i]) for i in present]
    return flat, present, tensors


def _with_shard(data, flat, present, shard):
    leaves = list(flat)
    for i, t in zip(present, shard):
        leaves[i] = t
    return tf.nest.pack_sequence_as(data, leaves)


def _run(mirrored, data, method):
    own_rows = _rows.is_per_replica(data)
    if own_rows:  # each replica's rows, as it received them
        flat = tf.nest.flatten(data)
        present = [i for i, t in enumerate(flat) if t is not None]
        shards, sizes, rows = mirrored._shards_of(
            [flat[i] for i in present])
    else:
        flat, present, tensors = _split(data)
        rows = tf.shape(tensors[0])[0]
        sizes = mirrored._plan_sizes(rows)
        shards = mirrored._distribute(tensors, sizes)
    offsets = split.offsets_tensor(sizes)
    step = getattr(mirrored._inner, method)
    n = mirrored._strategy.num_replicas_in_sync
    sources = {}

    def one_replica(shard, r):
        shard_data = _with_shard(data, flat, present, shard)
        # The plan's rows: 0 for an empty shard, which runs one stand-in
        # row (`_stand_in`) that counts for nothing.
        shard_rows = tf.gather(sizes, r)
        ctx = ReplicaContext(r, n, shard_rows, rows, distributed=True,
                             options=mirrored._comm_options,
                             gradient_dtype=mirrored._gradient_dtype,
                             offset=tf.gather(offsets, r),
                             shares_after_gradient=True)
        with activate(ctx):
            out = step(shard_data)
        samples = tf.reshape(tf.cast(shard_rows, tf.float32), [1])
        if method == "predict_step":
            return _stand_in.real_rows(out, shard_rows), samples
        vectors = _vectors(out, method, sources, produced)
        # A stand-in replica reports nothing of its own.
        vectors = {k: tf.where(shard_rows > 0, v, tf.zeros_like(v))
                   for k, v in vectors.items()}
        return vectors, samples

    def replica_step(shard):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return one_replica(shard, r)

    # Entered once around the replicas' trace (MirroredStrategy traces
    # each replica in a thread of its own); the hooks and the tape's
    # replacement act only in a thread with an active replica context.
    with mirrored._strategy.scope(), \
            _scope.replica_scope(mirrored, own_step=True) as produced, \
            _hooks(mirrored), _tape.per_row_targets():
        out = mirrored._strategy.run(replica_step, args=(shards,))
    if method == "train_step":
        _mixing.check(mirrored, shards)  # warns once of a whole-batch loss
    vectors, samples = mirrored._gather(out)
    if method == "predict_step":
        return vectors
    return _global_logs(vectors, samples, sources, mirrored.replica_stats)


def _flat(logs):
    """Keras's flattening of nested logs (`{'compile_metrics': {...}}`)."""
    out = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            out.update(_flat(value))
        else:
            out[key] = value
    return out


def _vectors(logs, method, sources, produced):
    """Each returned scalar as a [1] vector; notes which came from a metric
    (`produced`: the `_metric_weights.Produced` of this trace).
    """
    if not isinstance(logs, dict):
        raise TypeError(
            f"keras-mirror needs the wrapped model's `{method}` to return a "
            "dict of scalars (e.g. `{'d_loss': d_loss}`). "
            f"Received: {type(logs).__name__}")
    out = {}
    for key, value in _flat(logs).items():
        found = produced.source(value)
        if found is not None:
            sources.setdefault(key, found)
        value = tf.convert_to_tensor(value)
        if value.shape.rank != 0:
            raise ValueError(
                f"keras-mirror needs the wrapped model's `{method}` to return "
                f"scalars. Received: {key!r} with shape {value.shape}")
        out[key] = tf.reshape(tf.cast(value, tf.float32), [1])
    return out


def _global_logs(vectors, samples, sources, with_vectors=True):
    """`<key>`: a metric's result, else the share-weighted sum.

    A key whose value was a metric's `result()` (the Keras guides'
    `{m.name: m.result() for m in self.metrics}`, or a VAE's
    `{"loss": self.total_loss_tracker.result()}`) reports that metric read
    after every replica's update: its state is the global batch's. Any
    other scalar is combined by the replicas' shares (exact for per-batch
    means). `replica_<key>`: the per-replica vectors (not with
    `MirroredModel(replica_stats=False)`).
    """
    total = tf.reduce_sum(samples)
    share = tf.math.divide_no_nan(samples, total)
    logs = {}
    with tf.control_dependencies(tf.nest.flatten(vectors)):
        for key, vector in vectors.items():
            if key in sources:
                logs[key] = _metric_weights.read(*sources[key])
                continue
            logs[key] = tf.reduce_sum(
                tf.where(samples > 0, vector * share, tf.zeros_like(vector)))
    if with_vectors:
        for key, vector in vectors.items():
            logs[PREFIX + key] = vector
        logs[PREFIX + "samples"] = samples
    return logs
