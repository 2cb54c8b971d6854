"""Where a resumed `fit` restarts reading its input (used by `StepBackup`).

A `StepBackup` records the position `(epoch, step)`. Resuming there must
feed the model the very batches an uninterrupted run would have read, which
depends on how Keras walks the input (`keras.src.trainers.epoch_iterator`):

- without `steps_per_epoch`, every epoch reads the input from its start;
- with `steps_per_epoch` and an input of `num_batches` batches (arrays, a
  finite dataset), Keras carries its iterator across epochs: epoch `e` of a
  pass starts at batch `(e % E) * steps_per_epoch`, where
  `E = ceil(num_batches / steps_per_epoch)`, and the last epoch of a pass is
  cut short where the input ends;
- with `steps_per_epoch` and an endless input (`dataset.repeat()`), the
  iterator never restarts: epoch `e` starts at batch `e * steps_per_epoch`.

`plan` turns a position into at most three `fit` calls (segments), each on
the input without its first `skip` batches: the rest of the interrupted
epoch, the rest of its pass, and the following epochs on the whole input.
`validation_split` is turned into `validation_data` first, so that skipping
training rows never moves the validation boundary.
"""

import collections
import math

import keras
import numpy as np
import tensorflow as tf

from keras_mirror.distribute import _rows

Segment = collections.namedtuple(
    "Segment", ["skip", "first_epoch", "end_epoch", "steps_per_epoch"])


def split_validation(x, y, kwargs):
    """Applies `validation_split` as Keras would; returns (x, y, kwargs)."""
    kwargs = dict(kwargs)
    fraction = kwargs.pop("validation_split", 0.0)
    if not fraction or kwargs.get("validation_data") is not None:
        return x, y, kwargs
    if not _rows.is_array(x):
        raise ValueError(
            "`validation_split` is only supported for arrays. "
            f"Received: x={type(x).__name__}")
    weights = kwargs.pop("sample_weight", None)
    rows = _rows.num_rows(x)
    at = int(math.floor(rows * (1.0 - fraction)))

    def cut(t, start, end):
        return None if t is None else tf.nest.map_structure(
            lambda a: _rows.between(a, start, end), t)

    train = [cut(t, 0, at) for t in (x, y, weights)]
    kwargs["validation_data"] = tuple(cut(t, at, rows)
                                      for t in (x, y, weights))
    if train[2] is not None:
        kwargs["sample_weight"] = train[2]
    return train[0], train[1], kwargs


def num_batches(x, batch_size):
    """Batches in one pass over `x`; None for an endless input, -1 unknown."""
    if isinstance(x, tf.data.Dataset):
        card = int(x.cardinality())
        if card == tf.data.INFINITE_CARDINALITY:
            return None
        return card if card >= 0 else -1
    if isinstance(x, keras.utils.PyDataset):
        return x.num_batches if x.num_batches is not None else -1
    if _rows.is_array(x):
        return -(-_rows.num_rows(x) // (batch_size or 32))
    return -1


def epoch_steps(epoch, initial_epoch, steps_per_epoch, batches):
    """(first batch, steps) of `epoch` in an uninterrupted run."""
    if steps_per_epoch is None:
        return 0, (batches if batches and batches > 0 else None)
    if batches is None:  # endless input, one iterator for the whole run
        return (epoch - initial_epoch) * steps_per_epoch, steps_per_epoch
    if batches < 0:
        return None, steps_per_epoch
    per_pass = -(-batches // steps_per_epoch)
    start = ((epoch - initial_epoch) % per_pass) * steps_per_epoch
    return start, min(steps_per_epoch, batches - start)


def impossible_position(position, epochs, initial_epoch, steps_per_epoch,
                        batches):
    """Why a backup's `(epoch, step)` cannot be a position of this run (the
    epochs, `initial_epoch`, steps per epoch), or None if it can."""
    position = np.asarray(position)
    if position.shape != (2,) or position.dtype.kind not in "iu":
        return "it is not two integers"
    epoch, step = (int(v) for v in position)
    if not initial_epoch <= epoch <= epochs:
        return (f"the epoch must be in [{initial_epoch}, {epochs}] "
                f"(initial_epoch={initial_epoch}, epochs={epochs})")
    if step < 0 or (epoch == epochs and step > 0):
        return "the step must be 0 or more, and 0 after the last epoch"
    _, steps = epoch_steps(epoch, initial_epoch, steps_per_epoch, batches)
    if steps is not None and step > steps:
        return f"epoch {epoch} has {steps} step(s)"
    return None


def plan(position, epochs, initial_epoch, steps_per_epoch, batches):
    """The `fit` segments that resume at `position = (epoch, step)`."""
    epoch, step = position
    start, steps = epoch_steps(epoch, initial_epoch, steps_per_epoch,
                               batches)
    if steps is not None and step >= steps:
        epoch, step = epoch + 1, 0  # saved after an epoch's last batch
        start, steps = epoch_steps(epoch, initial_epoch, steps_per_epoch,
                                   batches)
    segments = []
    if step > 0:
        segments.append(Segment(
            _offset(start, step), epoch, epoch + 1,
            None if steps_per_epoch is None else steps - step))
        epoch += 1
    if steps_per_epoch is not None and batches is None:
        segments.append(Segment(
            (epoch - initial_epoch) * steps_per_epoch, epoch, epochs,
            steps_per_epoch))
        epoch = epochs
    elif steps_per_epoch is not None:
        start, _ = epoch_steps(epoch, initial_epoch, steps_per_epoch,
                               batches)
        if start:  # the rest of the current pass over the input
            end = epoch + _epochs_left_in_pass(start, steps_per_epoch,
                                               batches)
            segments.append(Segment(_offset(start, 0), epoch,
                                    min(end, epochs), steps_per_epoch))
            epoch = end
    segments.append(Segment(0, epoch, epochs, steps_per_epoch))
    return [s for s in segments if s.first_epoch < min(s.end_epoch, epochs)]


def _offset(start, step):
    if start is None:
        raise ValueError(
            "StepBackup cannot resume inside a run with `steps_per_epoch` "
            "over an input of unknown length: Keras carries its iterator "
            "across epochs and the resume point in the input is unknown. "
            "Give the dataset a known length "
            "(`dataset.apply(tf.data.experimental.assert_cardinality(n))`)"
            " or repeat it (`dataset.repeat()`). Received: x with unknown "
            "cardinality")
    return start + step


def _epochs_left_in_pass(start, steps_per_epoch, batches):
    return -(-(batches - start) // steps_per_epoch)


def skip(x, y, kwargs, batches, batch_size):
    """The input without its first `batches` batches; (x, y, kwargs)."""
    kwargs = dict(kwargs)
    if batches == 0:
        return x, y, kwargs
    if isinstance(x, tf.data.Dataset):
        return x.skip(batches), y, kwargs
    if not _rows.is_array(x) and \
            not isinstance(x, keras.utils.PyDataset):
        raise ValueError(
            "StepBackup resumes inside an epoch by skipping the batches "
            "already trained on, which needs arrays, a `tf.data.Dataset` or "
            f"a `keras.utils.PyDataset`. Received: x={type(x).__name__}")
    if kwargs.get("shuffle", True):
        raise ValueError(
            "StepBackup resumes inside an epoch by skipping its first "
            "batches, which needs the same batches on every run: pass "
            "`shuffle=False`. Received: shuffle=True")
    if isinstance(x, keras.utils.PyDataset):
        return SkippedPyDataset(x, batches), y, kwargs
    rows = batches * (batch_size or 32)

    def cut(t):
        return None if t is None else tf.nest.map_structure(
            lambda a: _rows.between(a, rows), t)

    if kwargs.get("sample_weight") is not None:
        kwargs["sample_weight"] = cut(kwargs["sample_weight"])
    return cut(x), cut(y), kwargs


class SkippedPyDataset(keras.utils.PyDataset):
    """A `PyDataset` without its first `skip` batches."""

    def __init__(self, dataset, skip):
        super().__init__(workers=dataset.workers,
                         use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self._dataset = dataset
        self._skip = skip

    def __len__(self):
        return max(0, len(self._dataset) - self._skip)

    def __getitem__(self, index):
        return self._dataset[index + self._skip]

    def on_epoch_begin(self):
        self._dataset.on_epoch_begin()

    def on_epoch_end(self):
        self._dataset.on_epoch_end()


def merge(before, after):
    """One `History` of consecutive `fit` calls."""
    if before is None:
        return after
    for k, v in before.history.items():
        after.history[k] = list(v) + list(after.history.get(k, []))
    after.epoch = list(before.epoch) + list(after.epoch)
    return after
