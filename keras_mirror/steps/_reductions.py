"""Which loss terms are batch means and which are batch sums.

A replica weights a term that is a mean over its shard by its share of the
global batch, `b_r / B`; a term that is a sum over the shard needs weight 1
(the shards' sums add up to the global sum); a term that depends on no data
(weight regularisation) is the same on every replica and counts once. A
`keras.losses.Loss` with `reduction="sum"`, one whose `call` returns a batch
sum, or a layer's `add_loss(ops.sum(x) * 0.1)`, is no mean: weighting it as
one would train differently from one device, silently.

The terms, each classified on its own (`docs/exactness.md`), by its value
and its gradient on the first real batch a step receives and on that batch
repeated twice (`_loss_terms`: computed as `fit` computes them, with
`training=True`, in a graph pruned to what they need, so that no metric,
moving statistic or seed state is written): a mean keeps both, a sum
doubles both. The nearer of the two wins, so float noise (a batch sum of
normalised outputs, whose value is ~0 but whose gradient is not; float16
rounding; a float16 sum that overflows on the doubled batch) decides
nothing; a term farther from both than a quarter of its size is neither,
and refused with an error naming it.

- each output's compiled loss (its entry in Keras's `CompileLoss`). Where
  the values cannot decide (0 with a 0 gradient, or not finite) a built-in
  Keras loss is classified by its `reduction` attribute. Each output's
  logged `<name>_loss` follows its kind.
- a `compute_loss` override: the compiled term as a whole, the same way;
- each `add_loss` term of the forward pass (activity regularisers
  included): the same way;
- weight regularisation: statically, counted once.

A term that is 0 with a 0 gradient (or not finite) on the first batch, and
has no `reduction` to go by, is weighted as a batch mean, with a warning
naming it: never refused for being 0.

The probe (`_loss_kinds.probe`) runs on one device, on the first batch
of the first train or test call (`_probing`), so that it reads nothing
the step would not read.
"""

import inspect
import warnings

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active
from keras_mirror.replica_context import note
from keras_mirror.steps import arithmetic

MEAN, SUM = "mean", "sum"
# A `reduction="mean_with_sample_weight"` loss: a mean weighted by the
# sample weights, `sum(w * l) / sum(w)` (a plain mean without them).
WEIGHTED = "weighted_mean"
# A replica's shard of `sum(w)` needs every replica's (an all-reduce).
WEIGHT_SUMS = ("a loss has reduction='mean_with_sample_weight', whose "
               "shares need every replica's sum of sample weights (an "
               "all-reduce)")


class Reductions:
    """The kinds of the compiled loss's terms and of each `add_loss` term.

    `outputs`: one kind per compiled output (Keras's own `compute_loss`),
    else None and `compiled` is the kind of the whole compiled term (an
    override). `extras`: one kind per term of `model.losses`.
    """

    def __init__(self, compiled=MEAN, extras=(), outputs=None, logged=None,
                 training=True):
        self.compiled = compiled
        self.extras = tuple(extras)
        self.outputs = None if outputs is None else tuple(outputs)
        # Each output's kind, for its logged `<name>_loss`.
        self.logged = self.outputs if logged is None else tuple(logged)
        # Classified on a training pass (`fit`) or an inference one.
        self.training = training

    def output_kind(self, i):
        if self.outputs is None or i >= len(self.outputs):
            return MEAN
        return self.outputs[i]

    def sum_trackers(self, model):
        """The per-output loss trackers whose values are batch sums."""
        kinds = self.logged or ()
        return [t for t, kind in zip(_compat.output_loss_trackers(model),
                                     kinds) if kind == SUM]

    def terms(self, shard_loss, extras, parts=None):
        """The terms of `shard_loss` not weighted as a plain batch mean.

        Each as `(value, kind, broadcast, weight_sum)` (see `_Term`);
        `parts`: the `_Shard` that `compute_loss` returned with it.
        """
        out = []
        dtype = arithmetic.loss_dtype(shard_loss)
        extras = [tf.cast(tf.reduce_sum(e), dtype) for e in extras]
        if len(extras) != len(self.extras):
            warnings.warn(
                f"The model's `add_loss` terms in training ({len(extras)}) "
                f"differ from those keras-mirror classified before the first "
                f"step ({len(self.extras)}); the training-only terms are "
                "weighted as batch means.", UserWarning, stacklevel=3)
            kinds = list(self.extras[:len(extras)]) + [MEAN] * max(
                0, len(extras) - len(self.extras))
        else:
            kinds = self.extras
        out += [(v, SUM, False, None) for kind, v in zip(kinds, extras)
                if kind == SUM]
        if self.outputs is None:
            if self.compiled == SUM:
                out.append((tf.cast(shard_loss, dtype) - (
                    tf.add_n(extras) if extras else 0.0), SUM, False, None))
            return out
        if parts is None:
            raise RuntimeError(
                "keras-mirror could not see the compiled loss's output "
                "terms of this replica's loss. Received: "
                f"shard_loss={shard_loss!r}")
        for term in parts.terms:
            kind = self.output_kind(term.index)
            if kind == WEIGHTED and term.weight_sum is None:
                kind = MEAN  # no sample weights: Keras's plain mean
            if kind != MEAN or term.broadcast:
                out.append((term.value, kind, term.broadcast,
                            term.weight_sum))
        return out

    def __repr__(self):
        return (f"Reductions(compiled={self.compiled!r}, "
                f"outputs={self.outputs}, extras={self.extras})")


class _Term:
    """One compiled output's part of a replica's loss (`compute_loss`).

    `value`: its sum over the shard, times its `loss_weights` entry.
    `broadcast`: a scalar beside an unreduced output (`reduction="none"`):
    Keras adds it to every element of that output's vector, whose sum is
    differentiated, so it counts once per element (a mean becomes a sum,
    a sum counts `b_r` times on a shard and `B` times on one device).
    `weight_sum`: the shard's sum of sample weights of a
    `"mean_with_sample_weight"` loss given them (`arithmetic.weight_sum`),
    else None.
    """

    def __init__(self, index, value, broadcast=False, weight_sum=None):
        self.index = index
        self.value = value
        self.broadcast = broadcast
        self.weight_sum = weight_sum


class _Shard:
    """What `compute_loss` saw of a replica's loss: its output terms, and
    for an unreduced (vector) loss the elements per row of that vector
    (None for a scalar loss)."""

    def __init__(self, terms, elements_per_row=None):
        self.terms = terms
        self.elements_per_row = elements_per_row


def weighted(reductions, model, shard_loss, extras, count, total, first,
             rows=None, parts=None):
    """Replica `r`'s term of the global loss (`arithmetic.contribution`).

    `parts`: the `_Shard` that `compute_loss` returned with `shard_loss`.

    Its batch means weighted by the share `count / total`, its batch sums
    by 1, a weighted mean by its share of the global sum of sample weights
    (one all-reduce of every such loss's shard sums), a term broadcast
    over an unreduced loss's elements divided by the row share `b_r / B`,
    weight regularisation counted once (on replica 0). A stand-in replica
    (`rows` 0, `_stand_in`) adds none of these terms. An unreduced loss's
    contribution is valued as Keras logs it, its elements' mean
    (`arithmetic.valued_as_mean`).
    """
    terms = (reductions.terms(shard_loss, extras, parts)
             if reductions is not None else [])
    dtype = arithmetic.loss_dtype(shard_loss)
    shard_loss = tf.cast(shard_loss, dtype)
    share = arithmetic.ratio(count, total, dtype)
    global_sums = _global_weight_sums(
        [t[3] for t in terms if t[1] == WEIGHTED])
    own, weighted_own = tf.zeros((), dtype), tf.zeros((), dtype)
    ctx = active()
    row_share = share if ctx is None else ctx.share_in(dtype)
    for value, kind, broadcast, weight_sum in terms:
        value = tf.cast(value, dtype)
        if kind == WEIGHTED:
            weight = arithmetic.ratio(weight_sum, global_sums.pop(0), dtype)
        else:
            weight = share if kind == MEAN else tf.ones((), dtype)
        if broadcast:
            weight = tf.math.divide_no_nan(weight, row_share)
        own += value
        weighted_own += weight * value
    if rows is not None:
        own = tf.where(rows > 0, own, tf.zeros_like(own))
        weighted_own = tf.where(rows > 0, weighted_own,
                                tf.zeros_like(weighted_own))
    out = arithmetic.contribution(
        shard_loss - own, arithmetic.weight_regularization(model, dtype),
        count, total, first) + weighted_own
    if parts is not None and parts.elements_per_row is not None:
        global_rows = total if ctx is None else ctx.global_batch_size
        out = arithmetic.valued_as_mean(
            out, tf.cast(global_rows, dtype) * tf.cast(
                parts.elements_per_row, dtype))
    return out


def _global_weight_sums(weight_sums):
    """The global batch's sums of sample weights, from the shards' sums.

    One all-reduce for all of them. In work traced once for all replicas
    the need is noted (`_one_trace`) and the step traces per replica.
    """
    if not weight_sums:
        return []
    ctx = active()
    stacked = tf.stack(weight_sums)
    if ctx is None or not ctx.distributed:
        return tf.unstack(stacked)
    if ctx._traced_once is not None:  # the single trace is being made
        note(WEIGHT_SUMS)
        return tf.unstack(stacked)
    return tf.unstack(ctx.all_reduce_sum(stacked))


def loss_weight(entry):
    weight = entry.loss_weights
    return 1.0 if weight is None else weight


def _reads_outputs(reductions, model):
    """Whether `reductions.terms` reads each compiled output's term: not
    where every output is a batch mean reduced to a scalar (weighted as
    the whole loss is), nor before the kinds are known."""
    if reductions is None or reductions.outputs is None:
        return False
    return any(kind != MEAN for kind in reductions.outputs) or any(
        getattr(e.loss, "reduction", None) not in _SCALAR_MEANS
        for e in _compat.flat_losses(model) or [])


_SCALAR_MEANS = ("sum_over_batch_size", "mean")


def call_compute_loss(model, x, y, y_pred, sample_weight, training,
                      report=True):
    """(loss, [(output index, unweighted value)]) of `model.compute_loss`
    (no values unless `report`)."""
    kwargs = dict(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    if "training" in inspect.signature(model.compute_loss).parameters:
        kwargs["training"] = training
    values = []
    if not report:
        return model.compute_loss(**kwargs), values
    with _compat.reporting_flat_losses(
            model, lambda i, v: values.append((i, v))):
        loss = model.compute_loss(**kwargs)
    return loss, values


def compute_loss(model, x, y, y_pred, sample_weight, training,
                 reductions=None):
    """The model's own `compute_loss` (an override too), as Keras calls it.

    Returns `(loss, parts)`: the loss as a float32 scalar (an unreduced
    loss, `reduction="none"`, a vector, as its sum, which is what Keras's
    step differentiates) and its `_Shard` (each compiled output's weighted
    term, where `reductions` reads them: `_reads_outputs`), for
    `weighted`; `(None, None)` without a loss.
    """
    loss, values = call_compute_loss(
        model, x, y, y_pred, sample_weight, training,
        report=_reads_outputs(reductions, model))
    if loss is None:
        return None, None
    loss = tf.convert_to_tensor(loss)
    loss = tf.cast(loss, arithmetic.loss_dtype(loss))
    unreduced = loss.shape.rank != 0
    entries = _compat.flat_losses(model) or []
    terms = []
    for i, v in values:
        if i >= len(entries):
            continue
        v = tf.cast(v, loss.dtype) * loss_weight(entries[i])
        broadcast = unreduced and v.shape.rank == 0
        if unreduced:
            v = tf.broadcast_to(v, tf.shape(loss))
        terms.append(_Term(i, tf.reduce_sum(v), broadcast, _weight_sum(
            entries[i], y_pred, sample_weight)))
    shard = _Shard(terms)
    if unreduced:
        shard.elements_per_row = tf.size(loss) // tf.shape(loss)[0]
        loss = tf.reduce_sum(loss)
    return loss, shard


def _weight_sum(entry, y_pred, sample_weight):
    """The shard's divisor of a `"mean_with_sample_weight"` output's loss
    given sample weights (as Keras resolves them per output), else None."""
    if sample_weight is None or not weighted_mean(entry.loss):
        return None
    sw = _at(entry.path, sample_weight)
    # In float64: the shares of the global sum are then exact to float64
    # precision, and rounded once to the loss's dtype (`arithmetic.ratio`).
    return arithmetic.weight_sum(
        sw, _compat.get_mask(_at(entry.path, y_pred)), tf.float64)


def _at(path, structure):
    """`structure`'s leaf at `path` (Keras's `resolve_path`), if nested."""
    if not tf.nest.is_nested(structure):
        return structure
    for key in path:
        structure = structure[key]
    return structure


def weighted_mean(loss):
    """Whether `loss` is a `Loss` Keras reduces by `sum(w * l) / sum(w)`."""
    return isinstance(loss, keras.losses.Loss) and \
        type(loss).__call__ is keras.losses.Loss.__call__ and \
        loss.reduction == "mean_with_sample_weight"
