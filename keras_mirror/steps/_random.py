"""Exact randomness inside replicas: one device's draws, this shard's rows.

Inside a replica step every replica holds the same seed generator state, so
a `keras.random` draw gets the same seed on every replica, as it would on one
device. What differs is the shape: a draw shaped like the replica's shard
(`keras.random.normal((batch, latent))`, a Dropout mask, GaussianNoise) asks
for `b_r` rows where one device asked for `B`. While a replica step is
traced, keras-mirror replaces the TF backend's shape-taking random functions
(`_compat.RANDOM_FUNCTIONS`) so that such a draw returns this replica's rows
of the draw one device makes for the global batch, with the same seed:

- a leading dimension that is a tensor equal to `k * b_r` (k >= 1) is read
  by how the graph made it (`_row_order`), `o_r` being the replica's first
  row in the global batch: rows made by a Reshape of the batch (`(b, T,
  d) -> (b * T, d)`) are example-major, and the replica gets the one run
  of rows `o_r * k ... (o_r + b_r) * k`; otherwise they are `k` stacked
  blocks of the batch (a GAN's `concatenate([ones(b), zeros(b)])` labels
  are `2 b_r` rows), and it gets rows `j * B + o_r ... j * B + o_r + b_r`
  of each block `j`. Rows whose making cannot be read are read as stacked
  blocks, with a warning (`UNREAD_ORDER`) once per draw;
- any other shape (static, or a leading dimension that is no multiple of the
  shard) is drawn as asked: a draw that does not depend on the batch is the
  same on every replica, as on one device.

Uniform, normal, truncated normal, randint and Dropout draw only the
replica's rows, by starting TF's counter-based Philox generator at the
rows' first counter (`_philox`): 1/N of the random numbers of the global
batch per replica. Gamma, binomial and beta have no such offset (their
samplers loop a data-dependent number of times per element): those are
drawn for the global batch and the replica's rows gathered, exact but N
times the work. `keras.random.categorical` of a shard's logits places them
at their rows of a global batch of logits (each row's samples depend on
the seed, the row's index and its own logits only; example-major logits
of `k` rows an example at their `k` rows each).

Each draw advances the seed generator once, as on one device, so the
generator's state after a step is one device's too. A draw without a
`seed` uses Keras's global seed generator, which the wrapper mirrors with
the model's variables (`_homes`): every replica reads and advances one
state, as one device does. Not exact (see README, "What is not exact"):
`keras.random.shuffle` of a shard (one device's permutation crosses the
shards; each replica gets its own), and stateful TF ops (`tf.random.normal`
without a seed generator), which draw per replica.
"""

import contextlib
import warnings

import keras
import tensorflow as tf

from keras_mirror import _compat
from keras_mirror.replica_context import active
from keras_mirror.steps import _philox
from keras_mirror.steps import _row_order


class _Drawn:
    """A seed already drawn: the replaced functions draw exactly once."""

    def __init__(self, value):
        self.value = value


def _context():
    ctx = active()
    if ctx is None or not ctx.distributed or getattr(ctx, "offset",
                                                     None) is None:
        return None
    return ctx


def _split_shape(shape):
    """`(leading, rest)` when the leading dimension is a dynamic tensor."""
    if isinstance(shape, tf.TensorShape) or shape is None:
        return None
    if tf.is_tensor(shape):
        if shape.shape.rank != 1 or tf.get_static_value(shape) is not None:
            return None
        shape = tf.cast(shape, tf.int32)
        return shape[0], shape[1:]
    if not isinstance(shape, (list, tuple)) or not shape:
        return None
    lead = shape[0]
    if not tf.is_tensor(lead) or tf.get_static_value(lead) is not None:
        return None
    rest = [tf.cast(d, tf.int32) for d in shape[1:]]
    rest = tf.stack(rest) if rest else tf.zeros([0], tf.int32)
    return tf.cast(lead, tf.int32), rest


def _static(shape):
    if tf.is_tensor(shape):
        return tf.TensorShape(None) if shape.shape.rank != 1 else \
            tf.TensorShape([None] * int(shape.shape[0] or 0)) \
            if shape.shape[0] is not None else tf.TensorShape(None)
    return tf.TensorShape([tf.get_static_value(d) if tf.is_tensor(d) else d
                           for d in shape])


def _run_rows(ctx, real):
    """The rows the replica's model runs: its shard and any stand-in rows
    (`ReplicaContext._run_rows`, None where they are the shard's)."""
    run = getattr(ctx, "_run_rows", None)
    return real if run is None else tf.cast(run, tf.int32)


def _rows(draw, shape, ctx, rows_at=None, order=None):
    """`draw(shape)`, with the global batch's rows when shaped like a shard.

    `rows_at(offset, count, rest)`, when given, draws rows `[offset, offset
    + count)` of the global draw alone (counter-offset Philox, `_philox`):
    each replica then generates its own rows only. Without it the draw is
    made for the global batch and the replica's rows are gathered (also in
    an XLA-compiled step, where sizes must be known when it compiles).
    `order(shape)`: how the rows are ordered (`_row_order`).
    """
    split = _split_shape(shape)
    if split is None:
        return draw(shape)
    lead, rest = split
    major = order is not None and order(shape) == _row_order.EXAMPLE_MAJOR
    real = tf.cast(ctx.shard_size, tf.int32)
    # A padded shard (`_stand_in.bounds`) runs `b` rows: its `real` ones,
    # then stand-in rows, which get the draws of the rows after them.
    b = _run_rows(ctx, real)
    big_b = tf.cast(ctx.global_batch_size, tf.int32)
    offset = tf.cast(ctx.offset, tf.int32)
    safe_b = tf.maximum(b, 1)
    blocks = lead // safe_b
    exact = (real > 0) & (lead > 0) & (tf.math.floormod(lead, safe_b) == 0)
    # Example-major: one run of `blocks` rows per example; stacked: `blocks`
    # runs (blocks of the batch) of one row per example.
    per, runs = (blocks, 1) if major else (1, blocks)

    def global_rows():
        full = draw(tf.concat([[blocks * big_b], rest], 0))
        index = tf.reshape(tf.range(runs)[:, None] * big_b * per
                           + offset * per + tf.range(b * per)[None, :], [-1])
        return tf.gather(full, tf.minimum(index, blocks * big_b - 1))

    def as_asked():
        return draw(tf.concat([[lead], rest], 0))

    # XLA needs each draw's size when it compiles; a shard's offset and rows
    # are values of the plan, so a compiled step gathers its rows.
    if rows_at is None or getattr(ctx, "_compiled", False):
        out = tf.cond(exact, global_rows, as_asked)
    elif major:
        out = rows_at(tf.where(exact, offset * per, 0),
                      tf.where(exact, b * per, lead), rest)
    else:
        out = _own_rows(rows_at, exact, offset, b, big_b, lead, blocks, rest)
    out.set_shape(_static(shape))
    return out


def _own_rows(rows_at, exact, offset, b, big_b, lead, blocks, rest):
    """This replica's rows of a draw of stacked blocks, generated alone
    (`_philox`).

    The first block takes no branch: it is rows `[offset, offset + b)` of
    the global draw where the shape is the shard's, else rows `[0, lead)`,
    which is the draw as asked, the same on every replica.
    Blocks after the first (`k` stacked blocks of the batch, a GAN's real
    and fake labels) are drawn one by one in a loop that is a function of
    its own, not inlined: the step's graph holds one call op, optimised
    and run only when a draw has more than one block (measured: the
    inlined loop and its branches were 0.3-0.5 s of a Dense + Dropout
    MLP's first step on 4 replicas).
    """
    first = rows_at(tf.where(exact, offset, 0), tf.where(exact, b, lead),
                    rest)

    def later():
        parts = tf.map_fn(lambda j: rows_at(j * big_b + offset, b, rest),
                          tf.range(1, blocks),
                          fn_output_signature=tf.TensorSpec(None, first.dtype))
        return tf.reshape(parts, tf.concat([[(blocks - 1) * b], rest], 0))

    more = tf.function(later, autograph=False,
                       experimental_attributes={"_noinline": True})
    return tf.cond(exact & (blocks > 1),
                   lambda: tf.concat([first, more()], 0), lambda: first)


UNREAD_ORDER = (
    "keras-mirror cannot read how the rows of the `keras.random.{name}` "
    "draw in the replica step were made (its leading dimension comes from "
    "a `{where}` op), so it reads them as stacked blocks of the batch, as "
    "a GAN's `concatenate([real, fake])`: where they are ordered otherwise "
    "the draw differs from one device's. Take the draw's shape from the "
    "tensor it applies to, e.g. `ops.shape(x)` of a Reshape of the batch "
    "(see docs/exactness.md, \"Randomness\"). Received: draw `{name}` with "
    "its leading dimension from `{where}`")


def _orders(first_time):
    """`order(shape, name)`: the draw's row order (`_row_order`), warning
    once per draw and op where it cannot be read (`first_time`)."""
    def order(shape, name):
        kind, where = _row_order.of_shape(shape)
        if kind == _row_order.UNKNOWN and first_time(
                "unread row order", (name, where)):
            warnings.warn(UNREAD_ORDER.format(name=name, where=where),
                          UserWarning, stacklevel=2)
        return kind

    return order


def _rows_at(name, module, seed, args, kwargs):
    """`rows_at` for `name`'s draw, as the TF backend makes it, or None.

    Bit for bit `tf.random.stateless_{normal,uniform,truncated_normal}`'s
    arithmetic on the raw draw (`rnd * scale + shift`). Gamma, binomial and
    beta have none: their samplers loop a varying number of times per
    element (gamma's rejection sampling; binomial and beta build on it).
    """
    if name not in _STANDARD:
        return None
    bound = _STANDARD[name](*args, **kwargs)
    dtype = tf.as_dtype(bound.get("dtype") or keras.config.floatx())
    seed = module._cast_seed(seed)
    if name == "randint":
        wide = dtype if dtype in (tf.int32, tf.int64) else tf.int64
        low = tf.cast(bound["minval"], wide)
        high = tf.cast(bound["maxval"], wide)

        def ints(offset, count, rest):
            out = _philox.rows("int", seed, offset, count, rest, wide, low,
                               high)
            return tf.cast(out, dtype)

        return ints
    if name == "uniform":
        low = tf.cast(bound.get("minval", 0.0), dtype)
        high = tf.cast(bound.get("maxval", 1.0), dtype)
        scale, shift = high - low, low
    else:
        scale = tf.convert_to_tensor(bound.get("stddev", 1.0), dtype)
        shift = tf.convert_to_tensor(bound.get("mean", 0.0), dtype)

    def floats(offset, count, rest):
        rnd = _philox.rows(name, seed, offset, count, rest, dtype)
        return tf.add(rnd * scale, shift)

    return floats


def _bind(*names):
    def bind(*args, **kwargs):
        bound = dict(zip(names, args))
        bound.update(kwargs)
        return bound

    return bind


# The TF backend's signatures after `shape` (and `seed=`, taken apart).
_STANDARD = {
    "normal": _bind("mean", "stddev", "dtype"),
    "truncated_normal": _bind("mean", "stddev", "dtype"),
    "uniform": _bind("minval", "maxval", "dtype"),
    "randint": _bind("minval", "maxval", "dtype"),
}


def _replacements(module, order):
    originals = {name: getattr(module, name)
                 for name in _compat.RANDOM_FUNCTIONS + ("draw_seed",)}

    # Keras's global state is per thread, and tf.distribute traces each
    # replica in a thread of its own: there Keras would make a new global
    # generator per replica. Unseeded draws take this thread's instead,
    # whose state the wrapper mirrors (`made_global_seed_generator`).
    shared = _compat.global_seed_generator()

    def draw_seed(seed):
        if isinstance(seed, _Drawn):
            return seed.value
        if seed is None and shared is not None:
            return shared.next(ordered=False)   # as Keras's `draw_seed`
        return originals["draw_seed"](seed)

    def shaped(name):
        original = originals[name]

        def fn(shape, *args, seed=None, **kwargs):
            ctx = _context()
            if ctx is None:
                return original(shape, *args, seed=seed, **kwargs)
            drawn = _Drawn(draw_seed(seed))
            rows_at = _rows_at(name, module, drawn.value, args, kwargs)
            return _rows(lambda s: original(s, *args, seed=drawn, **kwargs),
                         shape, ctx, rows_at, lambda s: order(s, name))

        fn.__name__ = name
        return fn

    def dropout(inputs, rate, noise_shape=None, seed=None):
        ctx = _context()
        if ctx is None or tf.is_tensor(rate) or rate in (0.0, 1.0):
            return originals["dropout"](inputs, rate, noise_shape=noise_shape,
                                        seed=seed)
        # `tf.nn.experimental.stateless_dropout`'s own arithmetic, with the
        # uniform draw made for the global batch.
        inputs = tf.convert_to_tensor(inputs)
        seed = module._cast_seed(draw_seed(seed))
        dims = (inputs.shape.as_list() if inputs.shape.rank is not None
                else None)
        if noise_shape is None and dims is None:
            shape = tf.shape(inputs)
        else:
            given = noise_shape if noise_shape is not None else [None] * len(
                dims)
            shape = [(d if d is not None else
                      dims[i] if dims and dims[i] is not None else
                      tf.shape(inputs)[i]) for i, d in enumerate(given)]
        uniform = _rows(
            lambda s: tf.random.stateless_uniform(s, seed=seed,
                                                  dtype=inputs.dtype),
            shape, ctx,
            lambda o, b, rest: _philox.rows("uniform", seed, o, b, rest,
                                            inputs.dtype),
            lambda s: order(s, "dropout"))
        scale = tf.convert_to_tensor(1 / (1 - rate), dtype=inputs.dtype)
        return tf.where(uniform >= rate, inputs * scale,
                        tf.zeros((), inputs.dtype))

    def categorical(logits, num_samples, dtype="int64", seed=None):
        ctx = _context()
        if ctx is None:
            return originals["categorical"](logits, num_samples, dtype=dtype,
                                            seed=seed)
        # Each row's samples depend on the seed, its row index and its own
        # logits only: the shard's logits, placed at its rows of a global
        # batch of logits, sample one device's numbers. Example-major
        # logits (`(b * T, vocab)`, `_row_order`) hold `per` rows an example.
        drawn = _Drawn(draw_seed(seed))
        logits = tf.convert_to_tensor(logits)
        b = tf.cast(ctx.shard_size, tf.int32)
        big_b = tf.cast(ctx.global_batch_size, tf.int32)
        offset = tf.cast(ctx.offset, tf.int32)

        def draw(value):
            return originals["categorical"](value, num_samples, dtype=dtype,
                                            seed=drawn)

        run = _run_rows(ctx, b)

        if logits.shape.rank != 2:
            return draw(logits)
        rows = tf.shape(logits)[0]
        per = 1
        if _row_order.of_rows(logits)[0] == _row_order.EXAMPLE_MAJOR:
            per = tf.maximum(rows // tf.maximum(run, 1), 1)

        def global_rows():
            # A padded shard's stand-in rows sample zeros (never used).
            padded = tf.pad(logits[:b * per], [
                [offset * per, (big_b - offset - b) * per], [0, 0]])
            out = draw(padded)[offset * per:(offset + b) * per]
            return tf.pad(out, [[0, (run - b) * per], [0, 0]])

        return tf.cond(tf.equal(rows, run * per) & (b > 0), global_rows,
                       lambda: draw(logits))

    def shuffle(x, axis=0, seed=None):
        ctx = _context()
        if ctx is None:
            return originals["shuffle"](x, axis=axis, seed=seed)
        # Not one device's permutation (that one crosses the shards), but a
        # different one on every replica.
        seed = draw_seed(seed)
        seed = seed + tf.cast(tf.stack([0, ctx.replica_id]), seed.dtype)
        return originals["shuffle"](x, axis=axis, seed=_Drawn(seed))

    replacements = {name: shaped(name) for name in _compat.RANDOM_FUNCTIONS
                    if name not in ("dropout", "categorical", "shuffle")}
    replacements["dropout"] = dropout
    replacements["categorical"] = categorical
    replacements["shuffle"] = shuffle
    replacements["draw_seed"] = draw_seed
    return replacements


@contextlib.contextmanager
def exact_draws(first_time):
    """Within the block, replica steps draw one device's random numbers.

    `first_time(what, reason)`: whether a warning is new (the wrapper's
    `StepState.first_time`: each is said once per wrapper).
    """
    module = _compat.random_module()
    with _compat.replaced(
            module, _replacements(module, _orders(first_time)),
            reason="a draw shaped like the shard gives this replica's rows "
            "of one device's draw for the global batch"):
        yield
