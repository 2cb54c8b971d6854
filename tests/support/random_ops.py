"""The random ops a traced step really ran, with their output sizes.

TF's debugger dump (`tf.debugging.experimental.enable_dump_debug_info`,
`tensor_debug_mode="SHAPE"`) records every op executed inside a graph, its
type and its output's element count; the dump is read back as the
`DebugEvent` records it is written in.
"""

import glob
import shutil
import tempfile

import tensorflow as tf
from tensorflow.core.protobuf import debug_event_pb2

DRAW_OPS = ("StatelessRandomUniformV2", "StatelessRandomNormalV2",
            "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
            "StatelessRandomUniformFullIntV2", "StatelessRandomGammaV3",
            "StatelessRandomBinomial", "StatelessMultinomial")


def _events(root, suffix):
    for path in glob.glob(f"{root}/**/*{suffix}", recursive=True):
        for record in tf.data.TFRecordDataset(path):
            yield debug_event_pb2.DebugEvent.FromString(record.numpy())


def random_draw_sizes(fn):
    """Runs `fn()`; returns `[(op_type, elements), ...]` of its draws."""
    root = tempfile.mkdtemp(prefix="km_random_ops_")
    tf.debugging.experimental.enable_dump_debug_info(
        root, tensor_debug_mode="SHAPE", circular_buffer_size=-1)
    try:
        fn()
    finally:
        tf.debugging.experimental.disable_dump_debug_info()
    try:
        types = {e.graph_op_creation.op_name: e.graph_op_creation.op_type
                 for e in _events(root, ".graphs")
                 if e.HasField("graph_op_creation")}
        sizes = []
        for event in _events(root, ".graph_execution_traces"):
            trace = event.graph_execution_trace
            kind = types.get(trace.op_name)
            if kind in DRAW_OPS:
                # SHAPE mode: [tensor id, dtype, rank, size, dims...].
                sizes.append((kind, int(
                    tf.make_ndarray(trace.tensor_proto)[3])))
        return sizes
    finally:
        shutil.rmtree(root, ignore_errors=True)
