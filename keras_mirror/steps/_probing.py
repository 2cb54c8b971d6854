"""The first train or test call classifies the loss terms on its own batch.

Unless they are known without it (`_loss_kinds.known`: built-in losses and
Keras's own layers), which `needs_probe` sets before any batch is read.

`_loss_kinds.probe` needs real rows: on a batch of zeros (all a `tf.data`
element spec gives without reading) a sum and a mean are both 0, and a
masked model gives NaN. Reading a batch ahead would make `fit` read more
than plain Keras does (a counting `map`, a `.cache()`). So the wrapper's
train and test functions take the first element of their first call's
iterator, classify the loss terms on it, and run the step on that same
element followed by the rest: each element is read once, by the step that
trains on it. Where the input's first element was read before the first
step anyway (`wrapper/_fit_input`: a generator's, a `PyDataset`'s item 0,
a dataset whose spec says too little), the pass classifies on it there
(`classify`) and the first call finds nothing left to probe.

For a `tf.data` iterator (what Keras's TensorFlow trainer always passes to
`fit` and `evaluate`), the first call's elements come from a one-off
dataset of the same element spec, so that Keras's multi-step function is
traced once, for both.
"""

import functools

import keras
import tensorflow as tf

from keras_mirror.distribute import _worker_input
from keras_mirror.steps import _loss_kinds


def needs_probe(mirrored, training=True):
    """Whether the wrapper's loss terms are still to be classified for a
    training (`fit`) or inference (`evaluate`) call.

    Terms classified by `evaluate` (an inference pass, as Keras runs it)
    are classified again by the first training call: a layer may add a
    loss in training only.
    """
    if mirrored._custom_step or not getattr(mirrored._inner, "compiled",
                                            False):
        return False
    reductions = mirrored._step_state.reductions
    if reductions is None:
        # Built-in losses and layers only: known without a probe.
        reductions = mirrored._step_state.reductions = _loss_kinds.known(
            mirrored._inner)
    return reductions is None or (training and not reductions.training)


def classify(mirrored, element, training=True):
    """Sets the wrapper's loss kinds from one element of the input."""
    if isinstance(element, dict) and set(element) == {_worker_input._MARK}:
        # This worker's rows (of its local replicas, on a cluster).
        element = _worker_input.local_rows(element[_worker_input._MARK])
    batch = keras.utils.unpack_x_y_sample_weight(element)
    mirrored._step_state.reductions = _loss_kinds.probe(
        mirrored._inner, batch, training)


def _steps(mirrored):
    return max(1, int(getattr(mirrored, "steps_per_execution", 1) or 1))


def _replay(mirrored, first, iterator):
    """An iterator of `first`, then the call's other elements of `iterator`.
    """
    rest = _steps(mirrored) - 1
    if not isinstance(iterator, tf.data.Iterator):
        def elements():
            yield first
            for _ in range(rest):
                try:
                    yield next(iterator)
                except StopIteration:
                    return

        return elements()

    def generate():
        yield first
        for _ in range(rest):
            try:
                yield next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                return

    return iter(tf.data.Dataset.from_generator(
        generate, output_signature=iterator.element_spec))


def first_call(mirrored, function, training=True):
    """Wraps a Keras train (`training`) or test `function` (see the module
    docstring)."""
    if function is None or getattr(function, "_probes_first_batch", False):
        return function

    @functools.wraps(function)
    def call(iterator):
        if not needs_probe(mirrored, training):
            return function(iterator)
        try:
            first = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            # An input that yields nothing: Keras's own end of data (its
            # "ran out of data" warning), as where nothing is probed.
            return function(iterator)
        classify(mirrored, first, training)
        return function(_replay(mirrored, first, iterator))

    call._probes_first_batch = True
    return call
