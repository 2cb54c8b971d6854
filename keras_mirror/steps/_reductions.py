"""Which loss terms are batch means and which are batch sums.

A replica weights a term that is a mean over its shard by its share of the
global batch, `b_r / B`; a term that is a sum over the shard needs weight 1
(the shards' sums add up to the global sum); a term that depends on no data
(weight regularisation) is the same on every replica and counts once. A
`keras.losses.Loss` whose `call` returns a batch sum, or a layer's
`add_loss(ops.sum(x) * 0.1)`, is no mean: weighting it as one would train
differently from one device, silently.

`probe` tells them apart by evaluating the model on a batch and on the same
batch twice over (its rows repeated), on one device, before the first step:
a mean (or a constant) keeps its value, a sum doubles. The compiled loss (with
any `compute_loss` override, minus the `add_loss` terms) is one term; each
`add_loss` term of the forward pass is one more. Anything else (a term that
neither keeps nor doubles, such as a sum of one output's loss and a mean of
another's) is refused with an error naming it.
"""

import inspect
import warnings

import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror.steps import _slicing

MEAN, SUM = "mean", "sum"
_RTOL = 1e-4


class Reductions:
    """The kind of the compiled loss and of each `add_loss` term."""

    def __init__(self, compiled=MEAN, extras=()):
        self.compiled = compiled
        self.extras = tuple(extras)

    @property
    def all_means(self):
        return self.compiled == MEAN and all(e == MEAN for e in self.extras)

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
        if self.compiled == SUM:
            compiled = tf.cast(shard_loss, tf.float32) - (
                tf.add_n(extras) if extras else 0.0)
            total += compiled
        return total

    def __repr__(self):
        return f"Reductions(compiled={self.compiled!r}, extras={self.extras})"


def _twice(structure):
    return tf.nest.map_structure(
        lambda t: None if t is None else _slicing.twice(t), structure)


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The model's own `compute_loss` (an override too), as Keras calls it."""
    kwargs = dict(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    if "training" in inspect.signature(model.compute_loss).parameters:
        kwargs["training"] = training
    return model.compute_loss(**kwargs)


def _evaluate(model, x, y, sample_weight):
    """(compiled loss, [add_loss terms]) of one batch, traced as in a step.

    In a `tf.function`, as the steps run: some layers (a `custom_gradient`
    reading a variable) only run traced.
    """

    @tf.function
    def terms(x, y, sample_weight):
        y_pred = model(x, training=False)
        extras = [tf.reduce_sum(tf.cast(e, tf.float32)) for e in model.losses]
        total = tf.reduce_sum(tf.cast(compute_loss(
            model, x, y, y_pred, sample_weight, False), tf.float32))
        return total, extras

    total, extras = terms(x, y, sample_weight)
    extras = [float(e) for e in extras]
    return float(total) - sum(extras), extras


def _kind(once, twice):
    scale = max(abs(once), abs(twice), 1e-12)
    if abs(twice - once) <= _RTOL * scale:
        return MEAN
    if abs(twice - 2 * once) <= _RTOL * scale:
        return SUM
    return None


def probe(model, batch):
    """Classifies `model`'s loss terms on `batch` (`(x, y, sample_weight)`)."""
    x, y, sample_weight = batch
    if x is None:
        return Reductions()
    compiled1, extras1 = _evaluate(model, x, y, sample_weight)
    compiled2, extras2 = _evaluate(model, _twice(x), _twice(y),
                                   _twice(sample_weight))
    kind = _kind(compiled1, compiled2)
    if kind is None:
        raise errors.LossReductionError(
            "keras-mirror weights each replica's loss by its share of the "
            "global batch when the loss is a batch mean, and by 1 when it "
            "is a batch sum; the compiled loss is neither (on a batch "
            f"repeated twice it went from {compiled1:.6g} to "
            f"{compiled2:.6g}): it may mix a sum and a mean (per output). "
            "Make every loss a mean (Keras's default reduction) or every "
            "one a sum. Received: loss="
            f"{_loss_name(model)}")
    kinds = []
    names = _compat.loss_owners(model)
    for i, (a, b) in enumerate(zip(extras1, extras2)):
        term = _kind(a, b)
        if term is None:
            owner = names[i] if i < len(names) else f"term {i}"
            raise errors.LossReductionError(
                "keras-mirror weights each `add_loss` term by its kind: a "
                "batch mean by the replica's share, a batch sum by 1. The "
                f"term added by {owner} is neither (on a batch repeated "
                f"twice it went from {a:.6g} to {b:.6g}). Make it a mean "
                "or a sum over the batch. Received: "
                f"add_loss term {i} of {owner}")
        kinds.append(term)
    return Reductions(kind, kinds)


def _loss_name(model):
    loss = getattr(model, "loss", None)
    return getattr(loss, "name", None) or getattr(
        loss, "__name__", None) or repr(loss)
