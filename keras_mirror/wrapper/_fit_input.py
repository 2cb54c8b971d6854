"""One pass over the input of `fit` (and `evaluate`, `predict`, `*_on_batch`).

`MirroredModel.fit` hands its arguments to `prepare_fit` and gives Keras
what comes back (a `FitInput`). The pass runs once, top to bottom, and
each stage returns to it; none calls back up:

1. Worker shards. With `worker_input="shard"`, a `tf.data.Dataset` or an
   `input_fn` becomes this worker's virtual shards
   (`distribute/_worker_input.virtual_input`).
2. Arguments. `_validate.check_fit_inputs` checks every argument and what
   the input says without reading it (cardinality, element spec, arrays'
   shapes and values).
3. The first element. `_inputs.First` holds the input's first element and
   reads it at most once, for every stage below that needs real rows: a
   generator's is peeked (and still trained on), a dataset's is read only
   when its spec says too little (a dynamic batch size in
   `"per_replica"` mode, open shapes for an unbuilt model, ragged leaves),
   a `PyDataset`'s is item 0.
4. The batch mode (`adapt`). In `"per_replica"` mode `N` consecutive
   batches are joined into one global batch and the split capacity is
   set (`steps/_capacity`); `validation_data` likewise.
5. Checks of a first batch and of `validation_data`
   (`_validate.check_more_fit_inputs`).
6. Build: the model, its compiled loss and metrics and its optimizers, on
   one device, from the spec or the first element
   (`_compile.ensure_built`); then the checks that need a built model.
7. The loss reductions: when the first element was read anyway, its loss
   terms are classified on it here (`steps/_probing.classify`); else the
   first step classifies them on its own first batch (`steps/_probing`).
8. Arrays sharded between workers (`_worker_input.shard_fit_input`).
9. Steps per epoch and the callback list (`ReplicaHistory` first).

Keras's `fit` then reads the input once per epoch, and each batch reaches
`MirroredModel.train_step` (`steps/dispatch.py`), which assembles this
worker's rows and runs the step on the chosen path.
"""

import keras
import tensorflow as tf

from keras_mirror.callbacks import replica_history
from keras_mirror.distribute import _input_fn
from keras_mirror.distribute import _worker_input
from keras_mirror.steps import _capacity
from keras_mirror.steps import _probing
from keras_mirror.wrapper import _compile
from keras_mirror.wrapper import _grouping
from keras_mirror.wrapper import _inputs
from keras_mirror.wrapper import _rebuild
from keras_mirror.wrapper import _validate


class FitInput:
    """`fit`'s input as Keras reads it: what `prepare_fit` returns.

    `x`, `y`, `batch_size`, `validation_data` and `kwargs` go to Keras's
    `fit`; `steps` is the number of steps per epoch (None: unknown);
    `first` the input's `_inputs.First` (`first.was_read` says whether its
    first element was read before the first step); `capacity` the split
    capacity (None: the balanced split of `batch="global"`); `verbose` and
    `callbacks` (a `ReplicaCallbackList`) are Keras's.
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def keras_kwargs(self):
        """The keyword arguments of Keras's `fit` besides `x` ... `epochs`.
        """
        return dict(self.kwargs, verbose=self.verbose,
                    callbacks=self.callbacks,
                    validation_data=self.validation_data)


def prepare_fit(mirrored, x, y, batch_size, epochs, verbose, callbacks,
                validation_data, steps_per_epoch, kwargs):
    """`fit`'s input, prepared in one pass (see the module docstring)."""
    sample_weight = kwargs.get("sample_weight")
    _inputs.check_some_input(mirrored._inner, x)
    if mirrored.worker_input != "shard":
        _input_fn.refuse_hint("x", x)
    _input_fn.refuse_hint("validation_data", validation_data)
    _inputs.refuse_endless("x", x, "steps_per_epoch", steps_per_epoch)
    _inputs.refuse_endless("validation_data", validation_data,
                           "validation_steps", kwargs.get("validation_steps"))
    x = _worker_input.virtual_input(mirrored, x, y, batch_size,
                                    steps_per_epoch)
    _validate.check_fit_inputs(mirrored, x, y, batch_size, steps_per_epoch,
                               kwargs, epochs, callbacks)
    first = _inputs.First(x)
    x, batch_size = adapt(mirrored, x, batch_size, first)
    validation_data, validation_first = _validation(mirrored,
                                                    validation_data)
    _validate.check_more_fit_inputs(mirrored, x, validation_data, kwargs,
                                    first, validation_first)
    _compile.ensure_built(mirrored, x, y, sample_weight, first)
    _validate.check_built_model(mirrored, x, y)
    _probe(mirrored, first)
    x, y, batch_size, kwargs = _worker_input.shard_fit_input(
        mirrored, x, y, batch_size, kwargs)
    verbose = 1 if verbose == "auto" else verbose
    steps = _inputs.count_steps(x, batch_size, steps_per_epoch,
                                kwargs.get("validation_split", 0.0))
    callbacks = replica_history.callback_list(mirrored, callbacks, verbose,
                                              epochs, steps)
    return FitInput(x=x, y=y, batch_size=batch_size,
                    validation_data=validation_data, kwargs=kwargs,
                    steps=steps, first=first, capacity=mirrored._capacity,
                    verbose=verbose, callbacks=callbacks)


def _validation(mirrored, validation_data):
    """(`validation_data` adapted to the batch mode, its `First` or None)."""
    if not isinstance(validation_data,
                      (tf.data.Dataset, keras.utils.PyDataset)):
        return validation_data, None
    capacity = mirrored._capacity
    first = _inputs.First(validation_data)
    validation_data, _ = adapt(mirrored, validation_data, None, first)
    if mirrored._capacity != capacity:
        # One capacity splits the training and the validation steps: a
        # smaller one would drop training rows, a larger validation rows.
        raise ValueError(
            "`validation_data` must have the per-replica batch size of `x` "
            f"({capacity} rows) with `batch='per_replica'`: the training "
            "and validation steps split by one capacity, and another would "
            "drop rows. Received: validation_data with batches of "
            f"{mirrored._capacity} rows")
    return validation_data, first


def adapt(mirrored, x, batch_size, first):
    """(x, batch_size) for Keras in the batch mode; sets the capacity.

    A generator comes back as one that yields its peeked first element
    first; in `"per_replica"` mode a dataset, `PyDataset` or generator
    comes back joining `N` consecutive batches, and arrays' `batch_size`
    is multiplied by `N`.
    """
    n = mirrored.num_replicas
    if _inputs.is_generator(x):
        capacity, x = _inputs.adapt_generator(x, n, mirrored.batch_mode,
                                              first)
    elif mirrored.batch_mode == "global":
        capacity = None
    elif isinstance(x, tf.data.Dataset):
        capacity = capacity_of(x, first)
        x = _grouping.group_dataset(x, n)
    elif isinstance(x, keras.utils.PyDataset):
        capacity = capacity_of(x, first)
        x = _grouping.GroupedPyDataset(x, n, first)
    else:
        capacity = batch_size or 32
        batch_size = capacity * n
    _capacity.set_capacity(mirrored, capacity)
    return x, batch_size


def capacity_of(dataset, first=None):
    """Rows in the first element of a per-replica dataset or `PyDataset`.

    Read from the element spec when the batch size is static; otherwise
    from the first element (`first`, an `_inputs.First` of `dataset`).
    """
    first = first if first is not None else _inputs.First(dataset)
    if isinstance(dataset, tf.data.Dataset):
        spec = keras.utils.unpack_x_y_sample_weight(dataset.element_spec)[0]
        rows = next(s for s in tf.nest.flatten(spec)
                    if s is not None).shape[:1].as_list()
        if rows and rows[0] is not None:  # batched with drop_remainder=True
            return rows[0]
    x = keras.utils.unpack_x_y_sample_weight(first.read())[0]
    return int(tf.shape(next(t for t in tf.nest.flatten(x)
                             if t is not None))[0])


def _probe(mirrored, first, training=True):
    """Classifies the loss terms on the first element if it was read.

    Else the first train or test call does, on its own first batch
    (`steps/_probing.first_call`): either way nothing is read for it.
    """
    if first.was_read and _probing.needs_probe(mirrored, training):
        with mirrored._homes.mirrored():
            _probing.classify(mirrored, first.read(), training)


def prepare_evaluate(mirrored, x, y, batch_size, kwargs):
    """`evaluate`'s (x, batch_size): adapted, checked, built, probed; its
    callbacks routed (`kwargs["callbacks"]`)."""
    sample_weight = kwargs.get("sample_weight")
    _inputs.check_some_input(mirrored._inner, x)
    _input_fn.refuse_hint("x", x)
    _inputs.refuse_endless("x", x, "steps", kwargs.get("steps"))
    first = _inputs.First(x)
    x, batch_size = adapt(mirrored, x, batch_size, first)
    _validate.check_inputs(mirrored, x, y, sample_weight,
                           batch_size=batch_size, first=first)
    _compile.ensure_built(mirrored, x, y, sample_weight, first)
    _probe(mirrored, first, training=False)
    replica_history.route_test_callbacks(mirrored, x, batch_size, kwargs)
    return x, batch_size


def prepare_predict(mirrored, x, batch_size, kwargs):
    """`predict`'s (x, batch_size): checked, adapted, the model built; its
    callbacks routed (`kwargs["callbacks"]`)."""
    _validate.check_predict_inputs(x, batch_size)
    _input_fn.refuse_hint("x", x)
    _inputs.refuse_endless("x", x, "steps", kwargs.get("steps"))
    first = _inputs.First(x)
    x, batch_size = adapt(mirrored, x, batch_size, first)
    if not mirrored._inner.built:
        _rebuild.build_from_batch(mirrored._inner, _inputs.first_x(x, first))
        mirrored._homes.refresh()
    replica_history.route_test_callbacks(mirrored, x, batch_size, kwargs)
    return x, batch_size


def prepare_batch(mirrored, x, y=None, sample_weight=None, predict=False):
    """One global batch of `train_on_batch` or `test_on_batch`, or (with
    `predict`) of `predict_on_batch`: checked, capacity set, built."""
    _inputs.check_some_input(mirrored._inner, x)
    if not predict:
        _validate.check_inputs(mirrored, x, y, sample_weight)
    _capacity.on_batch(mirrored, x)
    if not predict:
        _compile.ensure_built(mirrored, x, y, sample_weight)
    elif not mirrored._inner.built:
        _rebuild.build_from_batch(mirrored._inner, x)
        mirrored._homes.refresh()
