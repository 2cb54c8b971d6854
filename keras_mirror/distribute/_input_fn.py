"""Checks of what virtual shards are cut from, before any step runs.

An `input_fn(input_context)` is called once per virtual shard
(`_virtual_shards`), and the shards' batches are concatenated into each
global batch: the function must take one argument, and every shard must
yield the same structure, dtypes and shapes (the batch size aside), each
tensor with a batch dimension. Otherwise TensorFlow fails deep inside the
pipeline's `concat` (or, across workers, in the all-gather), naming
neither `input_fn` nor the shard.

(An `x` that nothing reads, a function outside virtual shards included,
is refused in `wrapper/_validate`.)
"""

import inspect

import tensorflow as tf


def check_signature(input_fn):
    """Raises ValueError unless `input_fn` takes one positional argument."""
    try:
        signature = inspect.signature(input_fn)
    except (TypeError, ValueError):  # a builtin without a signature
        return
    try:
        signature.bind(tf.distribute.InputContext())
    except TypeError:
        raise ValueError(
            "`input_fn` must take one argument, its virtual shard's "
            "`tf.distribute.InputContext` (`def input_fn(input_context): "
            "...`), and return that shard's `tf.data.Dataset`. "
            f"Received: input_fn={_name(input_fn)}{signature}") from None


def _name(fn):
    return getattr(fn, "__name__", None) or type(fn).__name__


def describe(spec):
    """A short text of an element spec: `(float32 (None, 3), ...)`."""
    def one(s):
        if not isinstance(s, tf.TensorSpec):
            return type(s).__name__
        if s.shape.rank is None:
            return f"{s.dtype.name} (unknown rank)"
        return f"{s.dtype.name} {tuple(s.shape.as_list())}"

    return str(tf.nest.map_structure(one, spec)).replace("'", "")


def _batch_dims(spec):
    """Whether every tensor of `spec` has a batch dimension (rank >= 1)."""
    return all(s.shape.rank is not None and s.shape.rank >= 1
               for s in tf.nest.flatten(spec)
               if isinstance(s, tf.TensorSpec))


def _same_element(a, b):
    """Whether two shards' batches can be concatenated row-wise."""
    try:
        tf.nest.assert_same_structure(a, b, check_types=True)
    except (TypeError, ValueError):
        return False
    for s, t in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        if type(s) is not type(t):
            return False
        if isinstance(s, tf.TensorSpec) and (
                s.dtype != t.dtype or s.shape.rank != t.shape.rank or
                not s.shape[1:].is_compatible_with(t.shape[1:])):
            return False
    return True


def check_specs(specs, source):
    """Raises ValueError unless the shards' element specs fit together.

    `specs` holds every virtual shard's element spec, in shard order;
    `source` names what they came from (`"input_fn"` or `"x"`).
    """
    first = specs[0]
    for index, spec in enumerate(specs):
        if not _batch_dims(spec):
            raise ValueError(
                f"`{source}` must give batches: every tensor of a virtual "
                "shard's elements needs a batch dimension first (end the "
                "pipeline with `batch(...)`). Received: virtual shard "
                f"{index} yields {describe(spec)}")
        if not _same_element(first, spec):
            raise ValueError(
                f"`{source}` must give every virtual shard the same "
                "structure, dtypes and shapes (the batch size aside): "
                "their batches are concatenated into each global batch. "
                f"Received: virtual shard {index} yields {describe(spec)}, "
                f"virtual shard 0 yields {describe(first)}")
