"""The first element of an input, read at most once, handed down the pass.

`wrapper/_fit_input.py` makes one `First` of the input before its stages
run and hands it to each stage that may need real rows: the checks of a
generator's (or a ragged dataset's) first batch (`_contents`), the
per-replica capacity of a dataset of dynamic batch size, a generator's
peek, a `PyDataset`'s item 0, the build of a model whose input shapes the
spec leaves open (`_inputs`), and the loss reduction probe. Whoever comes
first reads it; the others get the same element, so that the input's
first element is read once for all of them, and not at all when its spec
says enough.
"""

import collections.abc

import keras
import numpy as np
import tensorflow as tf

_UNREAD = object()


def empty_dataset(x):
    """The error for an input `x` that yields no batch."""
    return ValueError(
        "`x` must yield at least one batch, but the dataset is empty. "
        f"Received: x={x!r}")


def kind(x):
    """What `x` is: `"arrays"` (NumPy arrays or tensors, in any structure),
    `"dataset"`, `"pydataset"`, `"generator"` (a Python iterator), or
    None (anything else, refused by the checks)."""
    if isinstance(x, tf.data.Dataset):
        return "dataset"
    if isinstance(x, keras.utils.PyDataset):
        return "pydataset"
    if x is not None and all(
            isinstance(t, (np.ndarray, tf.Tensor, tf.SparseTensor,
                           tf.RaggedTensor))
            for t in tf.nest.flatten(x) if t is not None):
        return "arrays"
    if isinstance(x, collections.abc.Iterator):
        return "generator"
    return None


class First:
    """The first element of an input `x`, read at most once; `kind` says
    what `x` is (`kind(x)`).

    A generator's is `next(x)` (it then leads the generator that
    `_grouping.adapt` returns), a dataset's is `take(1)`, a
    `PyDataset`'s is item 0.
    """

    def __init__(self, x):
        self.x = x
        self.kind = kind(x)
        self._element = _UNREAD

    @property
    def was_read(self):
        return self._element is not _UNREAD

    def read(self):
        if self._element is _UNREAD:
            self._element = self._read()
        return self._element

    def _read(self):
        x = self.x
        if self.kind == "pydataset":
            return x[0]
        if self.kind == "dataset":
            try:
                return next(iter(x.take(1)))
            except (StopIteration, tf.errors.OutOfRangeError):
                raise empty_dataset(x) from None
        if self.kind == "generator":
            element = next(x, None)
            if element is None:
                raise ValueError(
                    "`x` must yield at least one batch, but the generator "
                    f"is empty. Received: x={x!r}")
            return element
        raise TypeError(f"`x` has no first element to read. "
                        f"Received: x={type(x).__name__}")
