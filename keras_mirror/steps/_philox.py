"""Rows of a stateless draw, drawn alone: Philox counters skipped ahead.

TF's stateless generators are counter-based. With `key, counter, alg =
tf.raw_ops.StatelessRandomGetKeyCounterAlg(seed)` and Philox (`alg == 1`,
what CPUs and GPUs pick), a draw of shape `[n, *rest]` fills its flat
elements group by group from consecutive counters: `per` elements per
group, `skip` counter increments per group. So rows `[o, o + b)` of the
draw are the elements `[r:]` of a draw of `b * D + r` elements whose counter
starts `g * skip` later, where `D = prod(rest)` and `g, r = divmod(o * D,
per)`. Measured (TF 2.21, CPU; `tests/steps/test_philox.py` checks it):

| op                              | dtype               | per | skip |
|---------------------------------|---------------------|-----|------|
| `StatelessRandomUniformV2`      | f16, bf16, f32      | 4   | 1    |
| `StatelessRandomUniformV2`      | f64                 | 2   | 1    |
| `StatelessRandomNormalV2`       | f16, bf16, f32      | 4   | 1    |
| `StatelessRandomNormalV2`       | f64                 | 2   | 1    |
| `StatelessTruncatedNormalV2`    | all                 | 4   | 256  |
| `StatelessRandomUniformIntV2`   | int32               | 4   | 1    |
| `StatelessRandomUniformIntV2`   | int64               | 2   | 1    |

Truncated normal reserves 256 counters per group for its rejection loop.
The counter is 128 bits (two uint64 words, low word first); the skip
carries into the high word.
"""

import tensorflow as tf

_UNIFORM = "uniform"
_NORMAL = "normal"
_TRUNCATED = "truncated_normal"
_INT = "int"

_OPS = {
    _UNIFORM: tf.raw_ops.StatelessRandomUniformV2,
    _NORMAL: tf.raw_ops.StatelessRandomNormalV2,
    _TRUNCATED: tf.raw_ops.StatelessTruncatedNormalV2,
}


def _group(kind, dtype):
    """`(per, skip)`: elements per Philox group, counters per group."""
    if kind == _TRUNCATED:
        return 4, 256
    wide = dtype in (tf.float64, tf.int64)
    return (2 if wide else 4), 1


def skip_counter(counter, increments):
    """`counter` (uint64 `[lo, hi]`) advanced by `increments`, with carry."""
    increments = tf.cast(increments, tf.uint64)
    low = counter[0] + increments
    carry = tf.cast(low < counter[0], tf.uint64)
    return tf.stack([low, counter[1] + carry])


def rows(kind, seed, offset, count, rest, dtype, minval=None, maxval=None):
    """Rows `[offset, offset + count)` of a stateless draw over `[n, *rest]`.

    Equal, bit for bit, to `tf.random.stateless_{kind}([n, *rest], seed,
    dtype=dtype)[offset:offset + count]` for any `n >= offset + count` (for
    `kind="int"`, `stateless_uniform` with `minval`/`maxval` and an integer
    dtype), when the device's algorithm is Philox; otherwise that draw is
    made for `offset + count` rows and sliced.

    Args:
        kind: str. `"uniform"`, `"normal"`, `"truncated_normal"` or `"int"`.
        seed: int32 tensor of shape `[2]`.
        offset, count: scalar integer tensors.
        rest: int32 tensor, the trailing dimensions.
        dtype: tf.DType of the draw.
        minval, maxval: tensors of `dtype`, for `kind="int"` only.

    Returns:
        A tensor of shape `[count, *rest]` (standard uniform, standard
        normal or standard truncated normal for the float kinds).
    """
    dtype = tf.as_dtype(dtype)
    per, skip = _group(kind, dtype)
    key, counter, alg = tf.raw_ops.StatelessRandomGetKeyCounterAlg(seed=seed)
    width = tf.reduce_prod(tf.cast(rest, tf.int64))
    start = tf.cast(offset, tf.int64) * width
    size = tf.cast(count, tf.int64) * width
    shape = tf.concat([[tf.cast(count, tf.int32)], tf.cast(rest, tf.int32)],
                      0)

    def philox():
        counter2 = skip_counter(counter, (start // per) * skip)
        lead = start % per
        flat = _draw(kind, [size + lead], key, counter2, 1, dtype, minval,
                     maxval)
        return tf.reshape(flat[lead:], shape)

    def sliced():
        flat = _draw(kind, [start + size], key, counter, alg, dtype, minval,
                     maxval)
        return tf.reshape(flat[start:], shape)

    return tf.cond(tf.equal(alg, 1), philox, sliced)


def _draw(kind, shape, key, counter, alg, dtype, minval, maxval):
    if kind == _INT:
        return tf.raw_ops.StatelessRandomUniformIntV2(
            shape=shape, key=key, counter=counter, alg=alg, minval=minval,
            maxval=maxval)
    return _OPS[kind](shape=shape, key=key, counter=counter, alg=alg,
                      dtype=dtype)
