"""How each loss term is classified: a batch mean or a batch sum.

The probe behind `_reductions.Reductions` (see `_reductions` for why the
kind matters): each term's value and gradient on the first real batch and
on that batch repeated twice (`_loss_terms`, which writes nothing). A mean
keeps both, a sum doubles both; the nearer of the two wins, so float noise
decides nothing, and a term farther from both than a quarter of its size
is neither and refused with an error naming it. A term that is 0 with a 0
gradient (or not finite) and has no `reduction` to go by is weighted as a
batch mean, with a warning naming it.
"""

import warnings

import keras
import numpy as np

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror.steps import _loss_terms
from keras_mirror.steps._reductions import MEAN
from keras_mirror.steps._reductions import SUM
from keras_mirror.steps._reductions import WEIGHTED
from keras_mirror.steps._reductions import Reductions
from keras_mirror.steps._reductions import loss_weight
from keras_mirror.steps._reductions import weighted_mean

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
    if loss.reduction in ("sum", "none", None):
        return SUM  # an unreduced loss's elements are summed (see `_Term`)
    return MEAN


def known(model):
    """The terms' kinds where no probe is needed, else None.

    Known without running the model when every compiled output's loss is a
    built-in Keras loss (its kind is its `reduction`), `compute_loss` is
    Keras's own, and every layer the model tracks is a Keras class with no
    activity regulariser: such layers add no `add_loss` term, so
    `model.losses` holds weight regularisation only. Anything else (a loss
    function of the user's, an own layer or model class, a keras-hub
    layer) is probed on the first batch.
    """
    entries = _compat.flat_losses(model)
    if _own_compute_loss(model) or not entries:
        return None  # not built yet, or no compiled loss: probed
    outputs = []
    for entry in entries:
        kind = _static_kind(entry.loss)
        if kind is None:
            return None
        outputs.append(WEIGHTED if kind == MEAN and weighted_mean(
            entry.loss) else kind)
    for layer in _compat.layers_within(model):
        if not type(layer).__module__.startswith("keras.") or getattr(
                layer, "activity_regularizer", None) is not None:
            return None
    regularised = sum(getattr(v, "regularizer", None) is not None
                      for v in model.trainable_weights)
    return Reductions(extras=[MEAN] * regularised, outputs=outputs)


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
        if kind not in (MEAN, SUM) and loss_weight(entry) == 0:
            kind = MEAN  # weighted 0: its kind changes nothing
        what = f"The loss of output {entry.name!r}"
        received = f"loss={_name(entry.loss)} for output {entry.name!r}"
        if kind == UNDECIDED:
            kind = _undecided(what, a, b, received)
        if kind is None:
            raise errors.LossReductionError(
                f"{_RULE}{what} is {_why(a, b)}. Make it a mean or a sum "
                f"over the batch. Received: {received}")
        if kind == MEAN and weighted_mean(entry.loss):
            kind = WEIGHTED  # a mean either way on a batch repeated twice
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
