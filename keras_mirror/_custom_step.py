"""Models with their own `train_step`: GANs and multi-optimizer training.

A model that overrides `train_step` (keras.io DCGAN / WGAN-GP style: its own
`compile(d_optimizer=..., g_optimizer=..., loss_fn=...)`, a step that calls
`self.d_optimizer.apply_gradients(...)`) runs unchanged under `MirroredModel`:

- `compile` is forwarded to the replica-mirrored copy of the model, inside the
  strategy's scope, with fresh copies of the optimizers passed in, so that
  their variables are mirrored. Every optimizer the copy then holds gets its
  gradient all-reduce replaced (see `_weighted_allreduce`).
- Each step splits the global batch by the split plan and runs the user's
  step once per replica, on its shard, in replica context. Keras's division
  of losses by the replica count is switched off meanwhile, so the step
  computes exactly what one device would on those rows.
- When the step applies gradients, each optimizer multiplies every gradient
  by the replica's share `b_r / B` (0 on an empty shard, never NaN) and sums
  over replicas. For a loss that is a mean over the batch, the sum is the
  gradient one device computes on the whole global batch.
- The scalars the step returns come back as per-replica vectors
  `replica_<key>` and as the share-weighted sum `<key>` (exact for per-batch
  means), beside `replica_samples`.

What differs from one device: randomness drawn inside the step (each
replica draws its own numbers: pass noise in with the data to be exact);
BatchNormalization statistics (per shard unless `synchronized=True`);
optimizer clipping (`clipnorm`, `global_clipnorm`, `clipvalue`), which Keras
applies before the all-reduce, so it clips each replica's unweighted shard
gradient; stateful metrics such as a running `Mean` of the loss, whose
per-replica results are combined with the current batch's shares.
"""

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import _rebuild
from keras_mirror import allreduce
from keras_mirror.replica_context import ReplicaContext
from keras_mirror.replica_context import activate
from keras_mirror.replica_context import active

PREFIX = "replica_"


def has_custom_step(model):
    """True when `model`'s class overrides `keras.Model.train_step`."""
    return type(model).train_step is not keras.Model.train_step


def can_compile_like(original):
    """Whether `MirroredModel` may re-compile from `original`'s config.

    A model with its own `compile` signature (a GAN's `d_optimizer=...`)
    cannot be compiled from Keras's compile config: the user calls
    `mirrored.compile(...)` with the same arguments instead.
    """
    return not (has_custom_step(original)
                and type(original).compile is not keras.Model.compile)


def setup(original, inner):
    """Prepares the two copies of a custom-step model; returns True if so.

    Models such as a GAN have no `call`, so they are never "built" by a
    forward pass, although their sub-models hold all the weights. Such a
    model is marked built (as Keras asks users to do under a strategy) and
    its weights are copied into the mirrored copy.
    """
    if not has_custom_step(original):
        return False
    if not original.built and original.weights:
        original.built = True
        if not inner.built and inner.weights:
            inner.built = True
        # `clone_in_scope` copies only built models' weights.
        _rebuild.copy_weights(original, inner)
    return True


# -- compile -----------------------------------------------------------------


def _fresh(value):
    """A new optimizer of the same class and config, made in this scope."""
    if isinstance(value, keras.optimizers.Optimizer):
        return value.__class__.from_config(value.get_config())
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _optimizers(model):
    """Every optimizer the model holds as an attribute (or in a list)."""
    found = []
    for value in list(vars(model).values()):
        items = value if isinstance(value, (list, tuple)) else (
            value.values() if isinstance(value, dict) else (value,))
        for item in items:
            if isinstance(item, keras.optimizers.Optimizer) and not any(
                    item is f for f in found):
                found.append(item)
    return found


def compile(mirrored, *args, **kwargs):
    """`MirroredModel.compile` for a model with its own `train_step`.

    Forwards every argument to the wrapped model's own `compile`, on the
    mirrored copy and inside the strategy's scope; then compiles the wrapper
    itself (no loss) so that Keras `fit` runs it. The wrapper's `optimizer`
    is a step counter: its `iterations` advance once per global step.
    """
    if kwargs.get("jit_compile") is True:
        raise ValueError(
            "`jit_compile=True` is not supported: XLA cannot compile a "
            "tf.distribute replica step. Received: jit_compile=True")
    inner = mirrored._inner
    with mirrored._strategy.scope():
        args = [_fresh(a) for a in args]
        kwargs = {k: _fresh(v) for k, v in kwargs.items()}
        inner.compile(*args, **kwargs)
    optimizers = _optimizers(inner)
    _build(optimizers, inner, mirrored._strategy)
    for optimizer in optimizers:
        _compat.replace_optimizer_allreduce(optimizer, _weighted_allreduce)
    counter = keras.optimizers.SGD(name="mirrored_step")
    counter.build([])
    keras.Model.compile(mirrored, optimizer=counter, jit_compile=False)


def _build(optimizers, inner, strategy):
    """Builds each unbuilt optimizer on all of the model's variables.

    Inside a replica step an optimizer cannot create its variables (Keras's
    step runs in the default strategy's context, whose variable creator
    refuses mirrored variables), and which variables each optimizer updates
    is known only to the step. So every optimizer that the model's own
    `compile` did not build is built here on all trainable variables: an
    optimizer may then update any subset of them, and slots of variables
    it never updates stay at their initial values.
    """
    variables = inner.trainable_variables
    if not variables:
        return
    with strategy.scope():
        for optimizer in optimizers:
            if not optimizer.built:
                optimizer.build(variables)


def _weighted_allreduce(original):
    """The replacement for an optimizer's `_all_reduce_sum_gradients`."""

    def all_reduce(grads_and_vars):
        ctx = active()
        if ctx is None:  # Not in a keras-mirror replica step.
            return original(grads_and_vars)
        pairs = list(grads_and_vars)
        grads = [None if g is None else ctx.weight(g) for g, _ in pairs]
        reduced = allreduce.all_reduce_sum(grads, ctx._options,
                                           ctx._gradient_dtype)
        return [(g, v) for g, (_, v) in zip(reduced, pairs)]

    return all_reduce


def metrics(mirrored, own):
    """The wrapper's metrics plus the wrapped model's (reset each epoch)."""
    if not getattr(mirrored, "_custom_step", False):
        return own
    inner = mirrored.__dict__.get("_inner")
    if inner is None or not inner.compiled:
        return own
    return list(own) + [m for m in inner.metrics
                        if not any(m is o for o in own)]


# -- the steps ---------------------------------------------------------------


def train_step(mirrored, data):
    """Runs the wrapped model's `train_step` on every replica's shard."""
    logs = _run(mirrored, data, "train_step")
    mirrored.optimizer.iterations.assign_add(1)
    return logs


def test_step(mirrored, data):
    """Runs the wrapped model's `test_step` on every replica's shard."""
    return _run(mirrored, data, "test_step")


def _run(mirrored, data, method):
    flat = tf.nest.flatten(data)
    present = [i for i, t in enumerate(flat) if t is not None]
    tensors = [tf.convert_to_tensor(flat[i]) for i in present]
    rows = tf.shape(tensors[0])[0]
    sizes = mirrored._plan_sizes(rows)
    shards = mirrored._distribute(tensors, sizes)
    step = getattr(mirrored._inner, method)
    n = mirrored.num_replicas

    def replica_step(shard):
        leaves = list(flat)
        for i, t in zip(present, shard):
            leaves[i] = t
        shard_data = tf.nest.pack_sequence_as(data, leaves)
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        shard_rows = tf.shape(shard[0])[0]
        ctx = ReplicaContext(r, n, shard_rows, rows, distributed=True,
                             options=mirrored._comm_options,
                             gradient_dtype=mirrored._gradient_dtype)
        with activate(ctx):
            logs = step(shard_data)
        samples = tf.reshape(tf.cast(shard_rows, tf.float32), [1])
        return _vectors(logs, method), samples

    # In the strategy's scope, an optimizer that the step builds on first
    # use creates mirrored variables, as under stock Keras.
    with mirrored._strategy.scope(), _compat.unscaled_losses():
        vectors, samples = mirrored._strategy.run(replica_step,
                                                  args=(shards,))
    vectors = mirrored._gather(vectors)
    samples = mirrored._gather(samples)
    return _global_logs(vectors, samples, mirrored.replica_stats)


def _vectors(logs, method):
    if not isinstance(logs, dict):
        raise TypeError(
            f"keras-mirror needs the wrapped model's `{method}` to return a "
            "dict of scalars (e.g. `{'d_loss': d_loss}`). "
            f"Received: {type(logs).__name__}")
    out = {}
    for key, value in logs.items():
        value = tf.convert_to_tensor(value)
        if value.shape.rank != 0:
            raise ValueError(
                f"keras-mirror needs the wrapped model's `{method}` to return "
                f"scalars. Received: {key!r} with shape {value.shape}")
        out[key] = tf.reshape(tf.cast(value, tf.float32), [1])
    return out


def _global_logs(vectors, samples, with_vectors=True):
    """`<key>`: share-weighted sums; `replica_<key>`: the vectors.

    Without the vectors (`MirroredModel(replica_stats=False)`), only the
    sums.
    """
    total = tf.reduce_sum(samples)
    share = tf.math.divide_no_nan(samples, total)
    logs = {}
    for key, vector in vectors.items():
        logs[key] = tf.reduce_sum(
            tf.where(samples > 0, vector * share, tf.zeros_like(vector)))
    if with_vectors:
        for key, vector in vectors.items():
            logs[PREFIX + key] = vector
        logs[PREFIX + "samples"] = samples
    return logs
