"""Which loss terms are batch means and which are batch sums.

A replica weights a term that is a mean over its shard by its share of the
global batch, `b_r / B`; a term that is a sum over the shard needs weight 1
(the shards' sums add up to the global sum); a term that depends on no data
(weight regularisation) is the same on every replica and counts once. A
`keras.losses.Loss` with `reduction="sum"`, one whose `call` returns a batch
sum, or a layer's `add_loss(ops.sum(x) * 0.1)`, is no mean: weighting it as
one would train differently from one device, silently.

The terms, each classified on its own (`docs/exactness.md`):

- each output's compiled loss (its entry in Keras's `CompileLoss`): by its
  value on the first real batch a step receives and on that batch repeated
  twice (a mean keeps its value, a sum doubles). Where those values cannot
  decide (0 both times, or not finite) a built-in Keras loss is classified
  by its `reduction` attribute; anything else is refused, never taken for
  a mean. Each output's logged `<name>_loss` follows its kind.
- a `compute_loss` override: the compiled term as a whole, the same way;
- each `add_loss` term of the forward pass: the same way;
- weight regularisation: statically, counted once.

The probe (`probe`) runs on one device, on the first batch of the first
train or test call (`_probing`), so that it reads nothing the step would
not read.
"""

import inspect
import math
import warnings

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror import errors
from keras_mirror.steps import _slicing
from keras_mirror.steps import arithmetic

MEAN, SUM = "mean", "sum"
_RTOL = 1e-4
# Set on the loss `compute_loss` returns: each output's weighted term.
_OUTPUT_TERMS = "_keras_mirror_output_terms"


class Reductions:
    """The kinds of the compiled loss's terms and of each `add_loss` term.

    `outputs`: one kind per compiled output (Keras's own `compute_loss`),
    else None and `compiled` is the kind of the whole compiled term (an
    override). `extras`: one kind per term of `model.losses`.
    """

    def __init__(self, compiled=MEAN, extras=(), outputs=None, logged=None):
        self.compiled = compiled
        self.extras = tuple(extras)
        self.outputs = None if outputs is None else tuple(outputs)
        # Each output's kind, for its logged `<name>_loss`.
        self.logged = self.outputs if logged is None else tuple(logged)

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


def _call_compute_loss(model, x, y, y_pred, sample_weight, training):
    """(loss, [(output index, unweighted value)]) of `model.compute_loss`."""
    kwargs = dict(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    if "training" in inspect.signature(model.compute_loss).parameters:
        kwargs["training"] = training
    values = []
    with _compat.reporting_flat_losses(
            model, lambda i, v: values.append((i, v))):
        loss = model.compute_loss(**kwargs)
    return loss, values


def compute_loss(model, x, y, y_pred, sample_weight, training):
    """The model's own `compute_loss` (an override too), as Keras calls it.

    As float32; it carries each compiled output's weighted term, which
    `Reductions.sum_terms` reads.
    """
    loss, values = _call_compute_loss(model, x, y, y_pred, sample_weight,
                                      training)
    if loss is None:
        return loss
    loss = tf.cast(loss, tf.float32)
    entries = _compat.flat_losses(model) or []
    terms = [(i, tf.cast(tf.reduce_sum(v), tf.float32) * _loss_weight(
        entries[i])) for i, v in values if i < len(entries)]
    setattr(loss, _OUTPUT_TERMS, terms)
    return loss


# -- the probe -----------------------------------------------------------------


def _twice(structure):
    return tf.nest.map_structure(
        lambda t: None if t is None else _slicing.twice(t), structure)


def _open_batch(once, twice):
    """Specs that take both `once` and `twice` (a batch, and it repeated):
    their batch dimension left open, so that one trace serves both."""
    def spec(a, b):
        if a is None:
            return None
        return tf.type_spec_from_value(a).most_specific_common_supertype(
            [tf.type_spec_from_value(b)])

    return tf.nest.map_structure(spec, once, twice)


def _terms_function(model):
    """A `tf.function` of one batch's loss terms (a new one per probe):
    (compiled total, [each `model.losses` term], {output: its term})."""

    # Without AutoGraph, as Keras traces its own step (`one_step_on_data` is
    # `do_not_convert`): the user's layers run unconverted in the probe too.
    @tf.function(autograph=False)
    def terms(x, y, sample_weight):
        y_pred = model(x, training=False)
        total, values = _call_compute_loss(model, x, y, y_pred,
                                           sample_weight, False)
        extras = [tf.reduce_sum(tf.cast(e, tf.float32)) for e in model.losses]
        outputs = {i: tf.reduce_sum(tf.cast(v, tf.float32))
                   for i, v in values}
        return tf.reduce_sum(tf.cast(total, tf.float32)), extras, outputs

    return terms


def _evaluate_both(model, batch):
    """The loss terms of `batch` and of it repeated twice (`_values`).

    Traced in a `tf.function`, as the steps run (some layers, a
    `custom_gradient` reading a variable, only run traced), once for both
    with the batch dimension open; where the model's forward pass cannot
    trace so (it reads its static batch size), once per batch.
    """
    batch = tf.nest.map_structure(
        lambda t: t if t is None or isinstance(
            t, (tf.SparseTensor, tf.RaggedTensor)) else tf.convert_to_tensor(t),
        batch)
    doubled = _twice(batch)
    terms = _terms_function(model)
    try:
        call = terms.get_concrete_function(*_open_batch(batch, doubled))
    except Exception:  # noqa: BLE001 - traced per batch below instead
        call = terms
    return _values(*call(*batch)), _values(*call(*doubled))


def _values(total, extras, outputs):
    """(compiled term, [model.losses terms], {output: value}) as floats."""
    extras = [float(e) for e in extras]
    return (float(total) - sum(extras), extras,
            {i: float(v) for i, v in outputs.items()})


UNDECIDED = "undecided"


def _kind(once, twice):
    """MEAN, SUM, None (neither) or UNDECIDED (0 twice, or not finite)."""
    if not (math.isfinite(once) and math.isfinite(twice)):
        return UNDECIDED
    scale = max(abs(once), abs(twice))
    if scale == 0.0:
        return UNDECIDED
    if abs(twice - once) <= _RTOL * scale:
        return MEAN
    if abs(twice - 2 * once) <= _RTOL * scale:
        return SUM
    return None


def _static_kind(loss):
    """A built-in Keras loss's kind from its `reduction`, else None."""
    if not _compat.keras_per_sample_loss(loss):
        return None
    return SUM if loss.reduction == "sum" else MEAN


class _NoTracking:
    """The per-output loss trackers do not count the probe's passes."""

    def __init__(self, model):
        self._trackers = _compat.output_loss_trackers(model)

    def __enter__(self):
        for tracker in self._trackers:
            tracker.update_state = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        for tracker in self._trackers:
            tracker.__dict__.pop("update_state", None)


def _kept_state(model):
    return [(v, tf.identity(v.value)) for v in model.non_trainable_variables]


def probe(model, batch):
    """Classifies `model`'s loss terms on `batch` (`(x, y, sample_weight)`).

    `batch` holds real rows (the first batch of the first step): a batch
    of zeros would give 0 or NaN and decide nothing.
    """
    x, y, sample_weight = batch
    if x is None:
        return Reductions()
    state = _kept_state(model)
    with _NoTracking(model):
        once, twice = _evaluate_both(model, (x, y, sample_weight))
    for v, value in state:
        v.assign(value)
    extras = _extra_kinds(model, once[1], twice[1])
    if not _own_compute_loss(model) and _compat.flat_losses(model) is None:
        return Reductions(MEAN, extras)  # no compiled loss: `add_loss` only
    if _own_compute_loss(model):
        try:
            logged = _output_kinds(model, once[2], twice[2])
        except errors.LossReductionError:
            logged = None  # the override's own combination is what counts
        return Reductions(_compiled_kind(model, once[0], twice[0], logged),
                          extras, logged=logged)
    return Reductions(extras=extras,
                      outputs=_output_kinds(model, once[2], twice[2]))


def _own_compute_loss(model):
    return type(model).compute_loss is not keras.Model.compute_loss


def _compiled_kind(model, once, twice, outputs=None):
    kind = _kind(once, twice)
    if kind == UNDECIDED and outputs and len(set(outputs)) == 1:
        kind = outputs[0]  # every output's loss is of one kind
    if kind in (MEAN, SUM):
        return kind
    raise errors.LossReductionError(
        "keras-mirror weights each replica's loss by its share of the "
        "global batch when the loss is a batch mean, and by 1 when it is a "
        f"batch sum; the compiled loss is {_why(kind, once, twice)}. Make "
        "every loss a mean (Keras's default reduction) or every one a sum. "
        f"Received: loss={_loss_name(model)}")


def _why(kind, once, twice):
    values = f"(on the first batch and on it repeated twice it went from " \
             f"{once:.6g} to {twice:.6g})"
    if kind is None:
        return f"neither {values}"
    return f"undecidable: it is 0 or not finite {values}"


def _output_kinds(model, once, twice):
    kinds = []
    for i, entry in enumerate(_compat.flat_losses(model) or ()):
        a, b = once.get(i, 0.0), twice.get(i, 0.0)
        kind = _kind(a, b)
        if kind == UNDECIDED:
            kind = _static_kind(entry.loss) or UNDECIDED
        if kind not in (MEAN, SUM) and _loss_weight(entry) == 0:
            kind = MEAN  # weighted 0: its kind changes nothing
        if kind not in (MEAN, SUM):
            raise errors.LossReductionError(
                "keras-mirror weights each output's loss by its kind: a "
                "batch mean by the replica's share, a batch sum by 1. "
                f"The loss of output {entry.name!r} is {_why(kind, a, b)}. "
                "Make it a mean or a sum over the batch. Received: "
                f"loss={_name(entry.loss)} for output {entry.name!r}")
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
        if term not in (MEAN, SUM):
            raise errors.LossReductionError(
                "keras-mirror weights each `add_loss` term by its kind: a "
                "batch mean by the replica's share, a batch sum by 1. The "
                f"term added by {names[i]} is {_why(term, a, b)}. Make it "
                "a mean or a sum over the batch. Received: "
                f"add_loss term {i} of {names[i]}")
        kinds.append(term)
    return kinds


def _name(loss):
    return getattr(loss, "name", None) or getattr(
        loss, "__name__", None) or repr(loss)


def _loss_name(model):
    return _name(getattr(model, "loss", None))
