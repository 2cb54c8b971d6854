"""A model's own `train_step` that mixes a shard's rows: found once, warned.

A loss over the whole batch (in-batch negatives, NT-Xent, a CLIP-style
similarity matrix) computed in a replica's step sees only the replica's
shard, and nothing fails: training just differs from one device. Such a
step has a tensor with two dimensions that grow with the batch (`[b, b]`
for `b` rows: the shard against itself), which a per-row or per-batch-mean
step never has: a Dense layer's `[b, units]`, a GAN's `[2b, 1]`, a VAE's
per-row KL `[b]`, BatchNormalization's `[units]` statistics.

The shard's row count is unknown in the traced step, so no shape says
which dimensions are the batch's. `scan` therefore imports the step's
graph once into a throwaway `tf.Graph`, with replica 0's shard fed by
placeholders of `b` rows, and lets TensorFlow's own shape inference
(every op's shape function, constant shapes folded) give each tensor's
static shape. `b` is a prime larger than every static dimension of the
step's graph, so a dimension that is a multiple of `b` grew with the
shard, and a feature dimension never is one. Nothing is run and no Python
code of the user's runs twice.

`all_gather`'s result (every replica's rows, `replica_context()`) is not
the shard's: its rows are unknown to shape inference, so an exact step
that scores its shard against the gathered batch (`[b, B]`) is not warned
of. Not seen: ops inside a `tf.cond`, `tf.while_loop` or nested
`tf.function` (their shapes come from their own trace).
"""

import logging
import warnings

import tensorflow as tf

WHAT = "whole-batch tensor"


def check(mirrored, shards):
    """Warns once per wrapper if replica 0's traced own `train_step`
    (`shards`: the per-replica shards it ran on) mixes its shard's rows.

    Not with one replica, whose shard is the whole batch (exact), nor in a
    step run eagerly (no graph to scan).
    """
    if mirrored._strategy.num_replicas_in_sync == 1 or \
            tf.executing_eagerly() or \
            not mirrored._step_state.first_time(WHAT, "scanned"):
        return
    shard = [t for t in tf.nest.flatten(
        mirrored._strategy.experimental_local_results(shards)[0])
        if isinstance(t, tf.Tensor)]
    if not shard:
        return
    found = scan(shard[0].graph, shard)
    if found is not None:
        warnings.warn(message(*found), UserWarning, stacklevel=2)


def scan(graph, shard):
    """`(op name, shape)` of the first tensor of `graph` with two dimensions
    that grow with `shard`'s rows (rows as `"b"`, `"2b"`), or None."""
    rows = _prime_above(_largest_dim(graph))
    probe = tf.Graph()
    with probe.as_default():
        feeds = {t.name: tf.compat.v1.placeholder(
            t.dtype, tf.TensorShape([rows]).concatenate(t.shape[1:]))
            for t in shard if t.shape.rank}
        try:
            tf.graph_util.import_graph_def(graph.as_graph_def(),
                                           input_map=feeds, name="probe")
        except ValueError as error:
            # Shape inference with `rows` rows disagrees with a shape the
            # trace fixed: the check is advisory, the step runs as traced.
            logging.getLogger("keras_mirror").info(
                "keras-mirror could not check the model's own `train_step` "
                "for whole-batch tensors: %s", error)
            return None
    for op in probe.get_operations():
        for t in op.outputs:
            dims = t.shape.as_list() if t.shape.rank else []
            if sum(1 for d in dims if d and d % rows == 0) >= 2:
                return op.name[len("probe/"):], _symbolic(dims, rows)
    return None


def message(name, shape):
    return (
        f"The model's own `train_step` computes `{name}` of shape {shape}, "
        "where b is the rows of one replica's shard: it mixes the shard's "
        "rows (an in-batch similarity matrix, a softmax over in-batch "
        "negatives). Under MirroredModel each replica sees only its shard, "
        "so this loss differs from one device's. Score the shard against "
        "`keras_mirror.replica_context().all_gather(...)`, the global "
        "batch's rows, to train exactly; see docs/exactness.md, "
        "\"Whole-batch losses\".")


def _symbolic(dims, rows):
    def dim(d):
        if d is None:
            return "None"
        if d % rows:
            return str(d)
        return "b" if d == rows else f"{d // rows}b"

    return "(" + ", ".join(dim(d) for d in dims) + ")"


def _largest_dim(graph):
    """The largest static dimension of any tensor in `graph` (0: none)."""
    return max((d for op in graph.get_operations() for t in op.outputs
                if t.shape.rank for d in t.shape.as_list() if d),
               default=0)


def _prime_above(n):
    """The smallest prime above `n` and 1000 (never a feature's size)."""
    k = max(n, 1000) + 1
    while any(k % p == 0 for p in range(2, int(k ** 0.5) + 1)):
        k += 1
    return k
