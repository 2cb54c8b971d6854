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

The probe (`probe`) runs on one device, on the first batch of the first
train or test call (`_probing`), so that it reads nothing the step would
not read.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror.steps import _loss_terms
from keras_mirror.steps import arithmetic

MEAN, SUM = "mean", "sum"
# Set on the loss `compute_loss` returns: each output's weighted term.
_OUTPUT_TERMS = "_keras_mirror_output_terms"


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

    @property
    def all_means(self):
        kinds = self.extras + (self.outputs or (self.compiled,))
        return all(k == MEAN for k in kinds)

    def output_is_sum(self, i):
        return self.outputs is not None and i < len(self.outputs) and \
            self.outputs[i] == SUM

    def sum_trackers(self, model):
        """The per-output loss trackers whose values are batch sums."""
        kinds = self.logged or ()
        return [t for t, kind in zip(_compat.output_loss_trackers(model),
                                     kinds) if kind == SUM]

    def sum_terms(self, shard_loss, extras):
        """The part of `shard_loss` that is a batch sum (weight 1)."""
        total = tf.zeros((), tf.float32)
        if self.all_means:
            return total
        extras = [tf.cast(tf.reduce_sum(e), tf.float32) for e in extras]
        if len(extras) != len(self.extras):
            warnings.warn(
                f"The model's `add_loss` terms in training ({len(extras)}) "
                f"differ from those keras-mirror classified before the first "
                f"step ({len(self.extras)}); the training-only terms are "
                "weighted as batch means.", UserWarning, stacklevel=2)
            kinds = list(self.extras[:len(extras)]) + [MEAN] * max(
                0, len(extras) - len(self.extras))
        else:
            kinds = self.extras
        for kind, value in zip(kinds, extras):
            if kind == SUM:
                total += value
        if self.outputs is None:
            if self.compiled == SUM:
                total += tf.cast(shard_loss, tf.float32) - (
                    tf.add_n(extras) if extras else 0.0)
            return total
        terms = getattr(shard_loss, _OUTPUT_TERMS, None)
        if terms is None:
            raise RuntimeError(
                "keras-mirror could not see the compiled loss's output "
                "terms of this replica's loss. Received: "
                f"shard_loss={shard_loss!r}")
        for i, term in terms:
            if self.output_is_sum(i):
                total += term
        return total

    def __repr__(self):
        return (f"Reductions(compiled={self.compiled!r}, "
                f"outputs={self.outputs}, extras={self.extras})")


def weighted(reductions, model, shard_loss, extras, count, total, first,
             rows=None):
    """Replica `r`'s term of the global loss (`arithmetic.contribution`).

    Its batch means weighted by the share `count / total`, its batch sums
    by 1, weight regularisation counted once (on replica 0). A stand-in
    replica (`rows` 0, `_stand_in`) adds none of its batch sums.
    """
    summed = (reductions.sum_terms(shard_loss, extras)
              if reductions is not None else 0.0)
    if rows is not None:
        summed = tf.where(rows > 0, summed, 0.0)
    return arithmetic.contribution(
        shard_loss - summed, arithmetic.weight_regularization(model),
        count, total, first) + summed


def _loss_weight(entry):
    weight = entry.loss_weights
    return 1.0 if weight is None else weight


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The model's own `compute_loss` (an override too), as Keras calls it.

    As float32; it carries each compiled output's weighted term, which
    `Reductions.sum_terms` reads.
    """
    loss, values = _loss_terms.call_compute_loss(model, x, y, y_pred,
                                                 sample_weight, training)
    if loss is None:
        return loss
    loss = tf.cast(loss, tf.float32)
    entries = _compat.flat_losses(model) or []
    terms = [(i, tf.cast(tf.reduce_sum(v), tf.float32) * _loss_weight(
        entries[i])) for i, v in values if i < len(entries)]
    setattr(loss, _OUTPUT_TERMS, terms)
    return loss


# -- the probe -----------------------------------------------------------------

UNDECIDED = "undecided"
# A term's value and gradient on a batch repeated twice are its values on
# the batch (a mean) or twice them (a sum), up to float rounding; anything
# farther from both than a quarter of the term's own size is neither.
_NEITHER = 0.25


def _kind(once, twice):
    """MEAN, SUM, None (neither) or UNDECIDED (0 or not finite throughout).

    `once`, `twice`: a term's `(value, flat gradient)` on a batch and on it
    repeated twice (`_loss_terms`). The nearer of the two hypotheses wins:
    a batch sum of normalised outputs (value ~0, gradient not) or a
    `mixed_float16` loss (rounded to 3 digits) is still a sum.
    """
    a = np.concatenate([[once[0]], once[1]]).astype(np.float64)
    b = np.concatenate([[twice[0]], twice[1]]).astype(np.float64)
    # A float16 sum of the doubled batch can overflow where its gradient
    # does not: only what is finite on both batches is compared.
    finite = np.isfinite(a) & np.isfinite(b)
    a, b = a[finite], b[finite]
    size = np.linalg.norm(a)
    if size == 0.0:
        return UNDECIDED
    to_mean, to_sum = np.linalg.norm(b - a), np.linalg.norm(b - 2 * a)
    kind, miss = (MEAN, to_mean) if to_mean <= to_sum else (SUM, to_sum)
    return kind if miss <= _NEITHER * size else None


def _static_kind(loss):
    """A built-in Keras loss's kind from its `reduction`, else None."""
    if not _compat.keras_per_sample_loss(loss):
        return None
    return SUM if loss.reduction == "sum" else MEAN


def probe(model, batch, training=True):
    """Classifies `model`'s loss terms on `batch` (`(x, y, sample_weight)`).

    `batch` holds real rows (the first batch of the first step): on a
    batch of zeros most terms are 0 and decide nothing. Nothing the model
    holds changes (`_loss_terms`). `training`: as the call that probes
    (`fit`: True; `evaluate`: False) runs the model.
    """
    reductions = _probe(model, batch, training)
    reductions.training = training
    return reductions


def _probe(model, batch, training):
    x, _, _ = batch
    if x is None:
        return Reductions()
    once, twice = _loss_terms.evaluate(model, batch, training)
    extras = _extra_kinds(model, once.extras, twice.extras)
    if not _own_compute_loss(model) and _compat.flat_losses(model) is None:
        return Reductions(MEAN, extras)  # no compiled loss: `add_loss` only
    if _own_compute_loss(model):
        try:
            logged = _output_kinds(model, once.outputs, twice.outputs)
        except errors.LossReductionError:
            logged = None  # the override's own combination is what counts
        return Reductions(_compiled_kind(model, once.compiled,
                                         twice.compiled, logged),
                          extras, logged=logged)
    return Reductions(extras=extras, outputs=_output_kinds(
        model, once.outputs, twice.outputs))


def _own_compute_loss(model):
    return type(model).compute_loss is not keras.Model.compute_loss


_RULE = ("keras-mirror weights each replica's loss term by its kind: a "
         "batch mean by the replica's share of the global batch, a batch "
         "sum by 1. ")


def _compiled_kind(model, once, twice, outputs=None):
    kind = _kind(once, twice)
    if kind == UNDECIDED and outputs and len(set(outputs)) == 1:
        kind = outputs[0]  # every output's loss is of one kind
    what, received = "The compiled loss", f"loss={_loss_name(model)}"
    if kind == UNDECIDED:
        return _undecided(what, once, twice, received)
    if kind is None:
        raise errors.LossReductionError(
            f"{_RULE}{what} is {_why(once, twice)}. Make every loss a mean "
            f"(Keras's default reduction) or every one a sum. Received: "
            f"{received}")
    return kind


def _why(once, twice):
    return (f"neither (on the first batch and on it repeated twice it "
            f"went from {once[0]:.6g} to {twice[0]:.6g})")


def _undecided(what, once, twice, received):
    """MEAN, with a warning naming the term that decided nothing."""
    warnings.warn(
        f"{_RULE}{what} and its gradient are 0 or not finite on the first "
        f"batch (on it repeated twice it went from {once[0]:.6g} to "
        f"{twice[0]:.6g}), which tells neither: it is weighted as a batch "
        f"mean. Received: {received}", UserWarning, stacklevel=3)
    return MEAN


_NONE = (0.0, np.zeros([0]))


def _output_kinds(model, once, twice):
    kinds = []
    for i, entry in enumerate(_compat.flat_losses(model) or ()):
        a, b = once.get(i, _NONE), twice.get(i, _NONE)
        kind = _kind(a, b)
        if kind == UNDECIDED:
            kind = _static_kind(entry.loss) or UNDECIDED
        if kind not in (MEAN, SUM) and _loss_weight(entry) == 0:
            kind = MEAN  # weighted 0: its kind changes nothing
        what = f"The loss of output {entry.name!r}"
        received = f"loss={_name(entry.loss)} for output {entry.name!r}"
        if kind == UNDECIDED:
            kind = _undecided(what, a, b, received)
        if kind is None:
            raise errors.LossReductionError(
                f"{_RULE}{what} is {_why(a, b)}. Make it a mean or a sum "
                f"over the batch. Received: {received}")
        kinds.append(kind)
    return kinds


def _extra_kinds(model, once, twice):
    """Each `model.losses` term's kind: `add_loss` terms, then weights'."""
    names = _compat.loss_owners(model)
    kinds = []
    for i, (a, b) in enumerate(zip(once, twice)):
        if i >= len(names):  # weight regularisation: no data, counted once
            kinds.append(MEAN)
            continue
        term = _kind(a, b)
        what = f"The term added by {names[i]}"
        received = f"add_loss term {i} of {names[i]}"
        if term == UNDECIDED:
            term = _undecided(what, a, b, received)
        if term is None:
            raise errors.LossReductionError(
                f"{_RULE}{what} is {_why(a, b)}. Make it a mean or a sum "
                f"over the batch. Received: {received}")
        kinds.append(term)
    return kinds


def _name(loss):
    return getattr(loss, "name", None) or getattr(
        loss, "__name__", None) or repr(loss)


def _loss_name(model):
    return _name(getattr(model, "loss", None))
