"""What holds while the replicas' steps are traced, on every path."""

import contextlib
import warnings

import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.steps import _batchnorm
from keras_mirror.steps import _metric_weights
from keras_mirror.steps import _random


@contextlib.contextmanager
def replica_scope(mirrored, own_step=False):
    """One device's losses, random draws and metric weights, per replica
    (`own_step`: in a model's own step, Keras's built-in one otherwise).

    Yields the `_metric_weights.Produced` of the metrics' results. Only
    what the model needs is replaced (`docs/architecture.md` lists
    each replacement and its reason):

    - Keras does not divide losses by the replica count
      (`_compat.unscaled_losses`): each replica computes its shard's own
      loss and keras-mirror weights it;
    - in Keras's built-in step, `model.optimizer` does not all-reduce the
      gradients (`_compat.disable_optimizer_allreduce`): the step has,
      once (a model's own step enters `own_step.optimizer_hooks`);
    - `keras.random` draws give one device's numbers (`_random`);
    - the metrics a replica updates weigh it as one device would
      (`_metric_weights`: an output's loss that is a batch sum as a sum)
      and a stand-in row updates none; in the built-in step that is the
      per-output loss trackers and the layers' own metrics (none for most
      models), the compiled ones being updated outside the replicas;
    - BatchNorm's moments leave a stand-in row out and, for a plain layer,
      are the global batch's unless `batchnorm="per_replica"`
      (`_batchnorm.global_statistics`);
    - a stateful TF random op in the step (`tf.random.normal`), which
      draws per replica, is warned about once (`warn_stateful_draws`).
    """
    reductions = mirrored._step_state.reductions
    sums = reductions.sum_trackers(mirrored._inner) if reductions else ()
    layers = _batchnorm.kinds(mirrored)
    graph = tf.compat.v1.get_default_graph()
    version = graph.version
    with contextlib.ExitStack() as stack:
        stack.enter_context(_compat.unscaled_losses())
        if not own_step:
            # Keras's step applies `model.optimizer`, whose gradients the
            # step all-reduces itself, exactly once.
            stack.enter_context(_compat.disable_optimizer_allreduce(
                getattr(mirrored._inner, "optimizer", None)))
        stack.enter_context(_random.exact_draws(
            mirrored._step_state.first_time))
        produced = stack.enter_context(_metric_weights.replica_weights(
            mirrored._inner, sums, own_step=own_step))
        if layers.forward_collectives:
            stack.enter_context(_batchnorm.global_statistics(layers))
        yield produced
    warn_stateful_draws(mirrored, graph, version)


# TensorFlow's stateful random ops: each op in each replica's graph keeps its
# own state, so N replicas draw N sets of numbers where one device drew one
# (`keras.random` draws are stateless, from a seed generator: exact).
STATEFUL_RANDOM_OPS = frozenset({
    "RandomStandardNormal", "RandomUniform", "RandomUniformInt",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomShuffle",
    "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "StatefulStandardNormalV2", "StatefulUniform", "StatefulUniformInt",
    "StatefulUniformFullInt", "StatefulTruncatedNormal",
    "StatefulRandomBinomial",
})


def stateful_draws(graph, version=None):
    """The stateful random op types in `graph` (its functions included)
    added since `version`."""
    graph_def = graph.as_graph_def(from_version=version)
    nodes = list(graph_def.node) + [
        node for function in graph_def.library.function
        for node in function.node_def]
    return sorted({n.op for n in nodes if n.op in STATEFUL_RANDOM_OPS})


def warn_stateful_draws(mirrored, graph, version):
    """Warns once per wrapper when a replica step just traced into `graph`
    draws with stateful TF random ops (more than one replica)."""
    n = mirrored._strategy.num_replicas_in_sync
    if n < 2 or not isinstance(graph, tf.Graph) or \
            mirrored._step_state.stateful_warned or \
            tf.executing_eagerly():
        return
    # Every replica runs the same code: one look per traced graph (the
    # strategy path traces each replica into the same graph in turn).
    scanned = mirrored._step_state.scanned_graphs
    if graph in scanned:
        return
    scanned.add(graph)
    found = stateful_draws(graph, version)
    if not found:
        return
    mirrored._step_state.stateful_warned = True
    warnings.warn(
        "The step draws with stateful TensorFlow random ops "
        f"({', '.join(found)}; `tf.random.normal` and the like): each of the "
        f"{n} replicas draws its own numbers, so training "
        "is not one device's. Draw with `keras.random` and a "
        "`keras.random.SeedGenerator` (exact: one device's numbers, each "
        f"replica's rows). Received: ops {found} in the replica step",
        UserWarning, stacklevel=2)
