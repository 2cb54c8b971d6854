"""Counter-offset draws: rows of a stateless draw equal one device's rows.

Bit for bit against `tf.random.stateless_*` of the whole `[n, *rest]`
draw, for random offsets, row counts and trailing dimensions, every float
dtype and both integer dtypes; and the 128-bit counter's carry against
TF's own Philox, from a counter whose low word is about to wrap.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_mirror.steps import _philox

SEED = tf.constant([7, 123], tf.int32)
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]


def _whole(kind, shape, dtype):
    if kind == "uniform":
        return tf.random.stateless_uniform(shape, SEED, dtype=dtype)
    if kind == "normal":
        return tf.random.stateless_normal(shape, SEED, dtype=dtype)
    if kind == "truncated_normal":
        return tf.random.stateless_truncated_normal(shape, SEED, dtype=dtype)
    return tf.random.stateless_uniform(shape, SEED, minval=-3, maxval=17,
                                       dtype=dtype)


def _rows(kind, offset, count, rest, dtype):
    bounds = ((tf.constant(-3, dtype), tf.constant(17, dtype))
              if kind == "int" else (None, None))
    return _philox.rows(kind, SEED, offset, count, tf.constant(rest, tf.int32),
                        dtype, *bounds)


CASES = [(kind, dtype) for kind in ("uniform", "normal", "truncated_normal")
         for dtype in FLOATS] + [("int", tf.int32), ("int", tf.int64)]


@pytest.mark.parametrize("kind,dtype", CASES,
                         ids=[f"{k}-{d.name}" for k, d in CASES])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_rows_equal_the_whole_draws_rows(kind, dtype, data):
    n = data.draw(st.integers(1, 40))
    offset = data.draw(st.integers(0, n))
    count = data.draw(st.integers(0, n - offset))
    rest = data.draw(st.lists(st.integers(1, 5), max_size=2))
    whole = _whole(kind, [n] + rest, dtype)[offset:offset + count]
    got = _rows(kind, offset, count, rest, dtype)
    assert got.shape == whole.shape
    np.testing.assert_array_equal(got.numpy(), whole.numpy())


def test_a_large_offset_carries_into_the_high_word():
    key = tf.constant([11], tf.uint64)
    low = np.uint64(2**64 - 3)
    counter = tf.constant([low, 5], tf.uint64)
    whole = tf.raw_ops.StatelessRandomUniformV2(
        shape=[40], key=key, counter=counter, alg=1, dtype=tf.float32)
    for groups in (1, 2, 3, 9):   # 3 and 9 wrap the low word
        skipped = _philox.skip_counter(counter, groups)
        part = tf.raw_ops.StatelessRandomUniformV2(
            shape=[40 - 4 * groups], key=key, counter=skipped, alg=1,
            dtype=tf.float32)
        np.testing.assert_array_equal(part.numpy(),
                                      whole[4 * groups:].numpy())
    np.testing.assert_array_equal(
        _philox.skip_counter(counter, 9).numpy(), [6, 6])
