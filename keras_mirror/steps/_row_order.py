"""How a draw's rows are ordered, read from the graph that made its shape.

A replica's draw with a dynamic leading dimension `k * b_r` (`_random`)
stands for `k * B` rows of one device's draw; which of them are this
replica's depends on how the rows were made, read back through the ops
that made the leading dimension (`tensor.op`, `op.inputs`,
`tf.get_static_value`):

- `EXAMPLE_MAJOR`: the rows come from a Reshape of a tensor whose rows
  are the batch's (`(b, T, d) -> (b * T, d)`, `tf.repeat`): each example
  owns `k` consecutive rows, and the replica's are one run, rows
  `[o_r * k, (o_r + b_r) * k)`;
- `STACKED`: the rows are the batch's, or `k` blocks of them made by a
  concat or tile along axis 0, or a leading dimension `k * b` written by
  hand (a GAN's `concatenate([real, fake])` and `(2 * b, 1)` labels):
  block `j` holds rows `j * B + o_r ... j * B + o_r + b_r`;
- `UNKNOWN`: anything else (a Reshape of a time-major tensor, a Reshape
  of stacked blocks, shape arithmetic it cannot read).

Rows that are another dimension of a tensor are followed through a
Transpose and a slice taking one index of the leading dimensions: Keras's
`TimeDistributed` steps over `transpose(x)[t]`, whose rows are the
batch's.

Ops that keep the rows (elementwise, MatMul, BiasAdd, a convolution, a
Reshape that keeps the leading dimension, as `tf.tensordot`'s) are walked
through along the input of highest rank. An op that changes the row
count while the leading dimension stays dynamic (`tf.boolean_mask`, a
slice of rows) is walked through too and can be misread; a hand-written
`(tf.shape(x)[0] * T, d)` with a static `T` reads as stacked.
"""

import weakref

import tensorflow as tf

EXAMPLE_MAJOR = "example-major"
STACKED = "stacked"
UNKNOWN = "unknown"

_ROWS = "rows"      # the batch's own rows, one per example (k == 1)
_TIMES = "times"    # `k * b` written by hand: read as stacked
_MAX_DEPTH = 64     # nested Reshapes and shape reads before giving up
_SHAPED = ("Fill", "Empty", "StatelessRandomUniformV2",
           "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
           "StatelessRandomUniformIntV2", "StatelessRandomUniform",
           "StatelessRandomNormal", "StatelessTruncatedNormal",
           "StatelessRandomUniformInt")
# Where the rows start: a function's input, a branch's or a call's output.
_ORIGINS = ("Placeholder", "If", "StatelessIf", "Case", "StatelessCase",
            "While", "StatelessWhile", "PartitionedCall",
            "StatefulPartitionedCall", "IteratorGetNext")
# Per graph, each tensor's reading (by name: ops never change once made).
_CACHE = weakref.WeakKeyDictionary()


def of_shape(shape):
    """`(kind, op type)` of a draw's `shape`: a rank-1 tensor or a
    sequence whose first element is a tensor. The op type is where the
    reading stopped (for an `UNKNOWN` draw's warning; None where there is
    no graph to read, as for a shape of numbers), else None."""
    listed = isinstance(shape, (list, tuple))
    lead = (shape[0] if shape else None) if listed else shape
    if not tf.is_tensor(lead) or _eager(lead):
        return UNKNOWN, None
    reader = _Reader(lead.graph)
    return _public(reader.scalar(lead, 0) if listed
                   else reader.element(lead, 0, 0))


def of_rows(tensor):
    """`(kind, op type)` of the rows of `tensor` (its leading dimension)."""
    if _eager(tensor):
        return UNKNOWN, None
    return _public(_Reader(tensor.graph).rows(tensor, 0))


def _public(found):
    kind, where = found
    return (STACKED if kind in (_ROWS, _TIMES) else kind), (
        where if kind == UNKNOWN else None)


def _eager(t):
    return tf.is_tensor(t) and getattr(t, "graph", None) is None


def _static(t):
    value = tf.get_static_value(t)
    return None if value is None else value.tolist()


class _Reader:
    def __init__(self, graph):
        self.memo = _CACHE.setdefault(graph, {})

    def rows(self, t, depth, axis=0):
        """How `t`'s rows (its dimension `axis`) were made, walked back
        through the ops that keep them (iteratively: a network is a long
        chain)."""
        chain = []
        while True:
            key = f"{t.name}@{axis}"
            if key in self.memo:
                found = self.memo[key]
                break
            chain.append(key)
            found, follow = (self._step(t.op, depth) if axis == 0 else
                             self._moved(t.op, axis, depth))
            if follow is None:
                break
            t, axis = follow if isinstance(follow, tuple) else (follow, 0)
        for ref in chain:
            self.memo[ref] = found
        return found

    def _moved(self, op, axis, depth):
        """`_step` for rows that are dimension `axis` of `op`'s output
        (`axis` > 0: Keras's `TimeDistributed` steps over
        `transpose(x)[i]`), and for the ops that move dimensions at any
        axis: followed through a Transpose, a slice that takes one index
        of the leading dimensions, a Pack or ExpandDims and (`axis` > 0)
        ops that keep every dimension; their origin is the batch's only
        where they are its leading dimension."""
        kind = op.type
        if depth > _MAX_DEPTH:
            return (UNKNOWN, kind), None
        if kind == "Transpose":
            perm = _static(op.inputs[1])
            if perm:
                return None, (op.inputs[0], perm[axis])
        elif kind == "StridedSlice":
            leading = _shrunk_leading(op)
            if leading is not None:
                return None, (op.inputs[0], axis + leading)
        elif kind in _INSERTS_AXIS:
            follow = _inserted(op, axis)
            if follow is not None:
                return None, follow
        elif kind == "TensorListStack" and axis == 1:
            # A loop's outputs stacked over its steps (Keras's RNNs, time
            # major): each step's rows start there, as a loop's do.
            return (_ROWS, None), None
        elif kind not in _ORIGINS and kind != "Reshape":
            follow = _same_rows(op)
            if follow is not None and follow.shape.rank == \
                    op.outputs[0].shape.rank:
                return None, (follow, axis)
        return (UNKNOWN, kind), None

    def _step(self, op, depth):
        """`(reading, None)` where `op` decides, else `(None, its input
        that holds the same rows)`, or `(None, (input, axis))` where they
        are its dimension `axis`."""
        kind = op.type
        if depth > _MAX_DEPTH:
            return (UNKNOWN, kind), None
        if kind == "Reshape":
            return self._reshape(op, depth + 1), None
        if kind in ("ConcatV2", "Concat"):
            values = list(op.inputs[:-1] if kind == "ConcatV2"
                          else op.inputs[1:])
            axis = _static(op.inputs[-1] if kind == "ConcatV2"
                           else op.inputs[0])
            rank = values[0].shape.rank
            if axis is None or rank is None:
                return (UNKNOWN, kind), None
            return ((STACKED, None), None) if axis % rank == 0 else (
                None, values[0])
        if kind == "Tile":
            first = _static_at(op.inputs[1], 0)
            if first is None:
                return (UNKNOWN, kind), None
            return ((STACKED, None), None) if first != 1 else (
                None, op.inputs[0])
        if kind in ("Transpose",) + _INSERTS_AXIS or (
                kind == "StridedSlice" and _shrunk_leading(op)):
            return self._moved(op, 0, depth)
        if kind in ("GatherV2", "ResourceGather"):
            axis = _static(op.inputs[2]) if kind == "GatherV2" else 0
            return None, op.inputs[1] if axis == 0 else op.inputs[0]
        if kind in _SHAPED:
            return self.element(op.inputs[0], 0, depth + 1), None
        follow = None if kind in _ORIGINS else _same_rows(op)
        return ((_ROWS, None), None) if follow is None else (None, follow)

    def _reshape(self, op, depth):
        """A Reshape that keeps the leading dimension names its rows (read
        from its target shape, `tf.tensordot`'s); one of the batch's rows
        makes them example-major; one of stacked blocks, unknown."""
        x, target = op.inputs
        lead = _static(target)
        if lead is None or not lead:
            found = self.element(target, 0, depth)
            if found[0] not in (UNKNOWN, _TIMES):
                return found
        inner = self.rows(x, depth)
        if inner[0] in (_ROWS, EXAMPLE_MAJOR):
            return EXAMPLE_MAJOR, None
        if lead and x.shape.rank and lead[0] == x.shape[0]:
            return inner  # a static batch, kept
        return inner if inner[0] == UNKNOWN else (UNKNOWN, "Reshape")

    def element(self, v, i, depth):
        """How element `i` of the shape vector `v` was made."""
        key = (v.name, i)
        if key not in self.memo:
            self.memo[key] = self._element(v, i, depth)
        return self.memo[key]

    def _element(self, v, i, depth):
        op = v.op
        kind = op.type
        if depth > _MAX_DEPTH:
            return UNKNOWN, kind
        if kind in ("Cast", "Identity"):
            return self.element(op.inputs[0], i, depth + 1)
        if kind == "Shape":
            return self.rows(op.inputs[0], depth + 1) if i == 0 else (
                UNKNOWN, "Shape")
        if kind == "ShapeN" and i == 0:
            return self.rows(op.inputs[v.value_index], depth + 1)
        if kind == "Pack" and op.get_attr("axis") == 0:
            return self.scalar(op.inputs[i], depth + 1)
        if kind == "ConcatV2":
            for part in op.inputs[:-1]:
                n = part.shape[0] if part.shape.rank == 1 else None
                if n is None:
                    break
                if i < n:
                    return self.element(part, i, depth + 1)
                i -= n
        if kind in ("StridedSlice", "Slice", "GatherV2"):
            start = _static(op.inputs[1])
            if kind == "GatherV2" and isinstance(start, list):
                return self.element(op.inputs[0], start[i], depth + 1)
            plain = kind == "Slice" or (
                op.get_attr("shrink_axis_mask") == 0 and
                op.get_attr("ellipsis_mask") == 0 and
                op.get_attr("new_axis_mask") == 0 and
                _static(op.inputs[3]) == [1])
            if start is not None and plain:
                first = 0 if kind == "StridedSlice" and op.get_attr(
                    "begin_mask") & 1 else start[0]
                return self.element(op.inputs[0], first + i, depth + 1)
        return UNKNOWN, kind

    def scalar(self, s, depth):
        """How the scalar `s`, a leading dimension, was made."""
        op = s.op
        kind = op.type
        if depth > _MAX_DEPTH:
            return UNKNOWN, kind
        if kind in ("Cast", "Identity"):
            return self.scalar(op.inputs[0], depth + 1)
        if kind == "StridedSlice" and op.get_attr("shrink_axis_mask") == 1:
            index = _static(op.inputs[1])
            if index is not None and index[0] >= 0:
                return self.element(op.inputs[0], index[0], depth + 1)
        if kind == "Mul":
            a, b = op.inputs
            factor, other = (a, b) if _static(a) is not None else (b, a)
            if _static(factor) is not None and _static(other) is None:
                found = self.scalar(other, depth + 1)
                # `k * b` written by hand: k stacked blocks, as a GAN's.
                if found[0] in (_ROWS, STACKED, _TIMES):
                    return _TIMES, None
                return found if found[0] == UNKNOWN else (UNKNOWN, "Mul")
        return UNKNOWN, kind


def _static_at(v, i):
    """Element `i` of the vector `v` where it is a constant, else None."""
    value = _static(v)
    if value is None and v.op.type == "Pack":
        return _static(v.op.inputs[i])
    return None if value is None else value[i]


# Ops whose output has one dimension more than their input, at `axis`.
_INSERTS_AXIS = ("Pack", "ExpandDims")


def _inserted(op, axis):
    """`(input, its dimension)` that dimension `axis` of a Pack's (a
    `TimeDistributed`'s `stack` of its steps) or ExpandDims's output is;
    None for the inserted dimension itself."""
    rank = op.outputs[0].shape.rank
    if op.type == "Pack":
        where = op.get_attr("axis")
    else:
        where = _static(op.inputs[1])
        where = where[0] if isinstance(where, list) and where else where
    if rank is None or where is None:
        return None
    where %= rank
    if axis == where:
        return None
    return op.inputs[0], axis if axis < where else axis - 1


def _shrunk_leading(op):
    """How many leading dimensions the StridedSlice `op` takes one index
    of (`x[i]`, `x[i, j]`), with every later dimension whole; None where
    it slices otherwise."""
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return None
    shrink = op.get_attr("shrink_axis_mask")
    leading = 0
    while shrink & (1 << leading):
        leading += 1
    if shrink >> leading:
        return None
    begin, strides = _static(op.inputs[1]), _static(op.inputs[3])
    if begin is None or strides is None or any(
            strides[d] != 1 or not (op.get_attr("end_mask") >> d & 1) or
            not (op.get_attr("begin_mask") >> d & 1 or begin[d] == 0)
            for d in range(leading, len(begin))):
        return None
    return leading


def _same_rows(op):
    """The input of `op` that holds `t`'s rows: of highest rank, one with a
    dynamic leading dimension first. None where there is none (a
    placeholder, a function's input: the rows start there)."""
    best = None
    for x in op.inputs:
        if x.dtype in (tf.resource, tf.variant) or not x.shape.rank:
            continue
        score = (x.shape.rank, x.shape[0] is None)
        if best is None or score > best[0]:
            best = (score, x)
    if best is None:
        return None
    return best[1]
