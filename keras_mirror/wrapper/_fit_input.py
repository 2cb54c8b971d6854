"""One pass over the input of `fit` (and `evaluate`, `predict`, `*_on_batch`).

`MirroredModel.fit` hands its arguments to `prepare_fit` and gives Keras
what comes back (a `FitInput`). The pass calls each stage once, in order,
with what the stage before returned; each stage keeps its helpers in its
own module and none calls back into an earlier one:

1. Worker shards (`distribute/_virtual_shards.fit_input`), with
   `worker_input="shard"` only: a `tf.data.Dataset` or an `input_fn`
   becomes this worker's virtual shards, read once per epoch.
2. The first element (`_first.First`): made here, read at most once by
   whichever stage below needs real rows first (a generator's is peeked
   and still trained on; a dataset's is read only when its spec says too
   little; a `PyDataset`'s is item 0).
3. The arguments (`_validate`): every argument and what the input says
   without reading it (its kind, cardinality, an endless dataset, a
   `SHARD_HINT` outside virtual shards).
4. The contents (`_contents`): values, rows, targets, sample weights and
   the model's input shapes, on arrays or on a first batch; and
   `validation_data`'s, which Keras would reach only after an epoch.
5. The batch mode (`_grouping`): in `"per_replica"` mode `N` consecutive
   batches are joined into one and the split capacity is set
   (`steps/_capacity`); `validation_data` likewise.
6. Steps per epoch and a batch to build from (`_inputs.prepare`).
7. Build (`_compile.ensure_built`): the model, then the checks that need
   it built (the labels' range), then its compiled loss and metrics and
   its optimizers, on one device, symbolically.
8. The loss reductions: when the first element was read anyway, its loss
   terms are classified on it here (`steps/_probing.classify`); else the
   first step classifies them on its own first batch.
9. With `worker_input="shard"`, arrays sharded between workers
   (`distribute/_worker_input.shard_fit_input`); Keras's `fit` then reads
   this worker's rows through `_worker_input.fit_reader`.

Keras's `fit` reads the input once per epoch, and each batch reaches
`MirroredModel.train_step` (`steps/dispatch.py`), which assembles this
worker's rows and runs the step on the chosen path.
"""

import keras
import tensorflow as tf

from keras_mirror.callbacks import replica_history
from keras_mirror.distribute import _virtual_shards
from keras_mirror.distribute import _worker_input
from keras_mirror.steps import _capacity
from keras_mirror.steps import _probing
from keras_mirror.wrapper import _compile
from keras_mirror.wrapper import _contents
from keras_mirror.wrapper import _first
from keras_mirror.wrapper import _grouping
from keras_mirror.wrapper import _inputs
from keras_mirror.wrapper import _validate


class FitInput:
    """`fit`'s input as Keras reads it: what `prepare_fit` returns.

    `x`, `y`, `batch_size`, `validation_data` and `kwargs` go to Keras's
    `fit`; `steps` is the number of steps per epoch (None: unknown);
    `first` the input's `_first.First` (`first.was_read` says whether its
    first element was read before the first step); `capacity` the split
    capacity (None: the balanced split of `batch="global"`); `callbacks`
    is a `ReplicaCallbackList`; `keras_kwargs` the keyword arguments of
    Keras's `fit` besides `x` ... `epochs` (`kwargs`, `verbose`,
    `callbacks`, `validation_data`).
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _first_of(data):
    if isinstance(data, (tf.data.Dataset, keras.utils.PyDataset)):
        return _first.First(data)
    return None


def prepare_fit(mirrored, x, y, batch_size, epochs, verbose, callbacks,
                validation_data, steps_per_epoch, kwargs):
    """`fit`'s input, prepared in one pass (see the module docstring)."""
    sample_weight = kwargs.get("sample_weight")
    if mirrored.worker_input == "shard":
        x = _virtual_shards.fit_input(mirrored, x, y, batch_size,
                                      steps_per_epoch)
    else:
        _virtual_shards.forget(mirrored)
    first = _first.First(x)
    validation_first = _first_of(validation_data)
    _validate.check_fit(mirrored, x, y, batch_size, epochs, steps_per_epoch,
                        callbacks, validation_data, kwargs)
    _contents.check_fit(mirrored, x, y, sample_weight, validation_data,
                        first, validation_first)
    x, batch_size, validation_data = _grouping.adapt_fit(
        mirrored, x, batch_size, validation_data, first, validation_first)
    steps, example = _inputs.prepare(
        mirrored, x, y, sample_weight, batch_size, steps_per_epoch, first,
        kwargs.get("validation_split", 0.0))
    _compile.ensure_built(mirrored, x, example, y)
    _probe(mirrored, first)
    if mirrored.worker_input == "shard":
        x, y, batch_size, kwargs = _worker_input.shard_fit_input(
            mirrored, x, y, batch_size, kwargs)
    verbose = 1 if verbose == "auto" else verbose
    callbacks = replica_history.callback_list(mirrored, callbacks, verbose,
                                              epochs, steps)
    return FitInput(x=x, y=y, batch_size=batch_size, kwargs=kwargs,
                    steps=steps, first=first, 
                    capacity=mirrored._step_state.capacity,
                    keras_kwargs=dict(kwargs, verbose=verbose,
                                      callbacks=callbacks,
                                      validation_data=validation_data),
                    callbacks=callbacks)


def _probe(mirrored, first, training=True):
    """Classifies the loss terms on the first element if it was read.

    Else the first train or test call does, on its own first batch
    (`steps/_probing.first_call`): either way nothing is read for it.
    """
    if first.was_read and _probing.needs_probe(mirrored, training):
        with mirrored._homes.mirrored():
            _probing.classify(mirrored, first.read(), training)


def prepare_evaluate(mirrored, x, y, batch_size, kwargs):
    """`evaluate`'s (x, batch_size): checked, adapted, built, probed; its
    callbacks routed (`kwargs["callbacks"]`)."""
    sample_weight = kwargs.get("sample_weight")
    first = _first.First(x)
    _validate.check_evaluate(mirrored, x, batch_size, kwargs)
    _contents.check(mirrored, x, y, sample_weight, first)
    x, batch_size = _grouping.adapt(mirrored, x, batch_size, first)
    steps, example = _inputs.prepare(mirrored, x, y, sample_weight,
                                     batch_size, kwargs.get("steps"), first)
    _compile.ensure_built(mirrored, x, example, y, training=False)
    _probe(mirrored, first, training=False)
    replica_history.route_test_callbacks(mirrored, steps, kwargs)
    return x, batch_size


def prepare_predict(mirrored, x, batch_size, kwargs):
    """`predict`'s (x, batch_size): checked, adapted, the model built; its
    callbacks routed (`kwargs["callbacks"]`)."""
    first = _first.First(x)
    _validate.check_predict(x, batch_size, kwargs)
    _contents.check_predict(x)
    x, batch_size = _grouping.adapt(mirrored, x, batch_size, first)
    steps, example = _inputs.prepare(
        mirrored, x, None, None, batch_size, kwargs.get("steps"), first,
        build=not mirrored._inner.built)
    _compile.build_model(mirrored, example)
    replica_history.route_test_callbacks(mirrored, steps, kwargs)
    return x, batch_size


def prepare_batch(mirrored, x, y=None, sample_weight=None, predict=False):
    """One global batch of `train_on_batch` or `test_on_batch`, or (with
    `predict`) of `predict_on_batch`: checked, capacity set, built."""
    _validate.check_batch(mirrored, x, sample_weight, predict)
    if not predict:
        _contents.check(mirrored, x, y, sample_weight)
    _capacity.on_batch(mirrored, x)
    _, example = _inputs.prepare(mirrored, x, y, sample_weight, None, 1,
                                 None)
    if predict:
        _compile.build_model(mirrored, example)
    else:
        _compile.ensure_built(mirrored, x, example, y, training=False)
