"""What a `tf.data` pipeline's graph says about how it can be sharded.

Read once per `fit` from the pipeline's `GraphDef` (`_compat.dataset_graph`):
the files it reads (TensorFlow marks a file list with a `FileIdentity` node,
for `list_files` and `TFRecordDataset([...])` alike), whether it has a file
reader at all, whether the user marked a `shard(SHARD_HINT, SHARD_HINT)`,
the size and `drop_remainder` of its last `batch`, and every `shuffle`
without a seed (its seeds are both 0, TensorFlow's "nondeterministic").
"""

import collections

import tensorflow as tf

from keras_mirror import _compat

READERS = frozenset({
    "TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
    "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2",
    "ArrayRecordDataset",
})
_BATCHES = frozenset({"BatchDataset", "BatchDatasetV2",
                      "ParallelBatchDataset", "PaddedBatchDatasetV2"})
_SHUFFLES = frozenset({"ShuffleDataset", "ShuffleDatasetV2",
                       "ShuffleDatasetV3", "ShuffleAndRepeatDataset",
                       "ShuffleAndRepeatDatasetV2"})
_SHARD_HINT = -1  # tf.data.experimental.SHARD_HINT

Pipeline = collections.namedtuple(
    "Pipeline", ["files", "has_reader", "has_hint", "batch_size",
                 "drop_remainder", "unseeded_shuffles"])


def _name(reference):
    return reference.lstrip("^").split(":")[0]


def _const(nodes, reference):
    """The value of a `Const` input (through `Identity`), or None."""
    node = nodes.get(_name(reference))
    while node is not None and node.op == "Identity" and node.input:
        node = nodes.get(_name(node.input[0]))
    if node is None or node.op != "Const":
        return None
    tensor = node.attr["value"].tensor
    if tensor.dtype == tf.string.as_datatype_enum:
        value = tf.io.parse_tensor(tensor.SerializeToString(), tf.string)
        return [s.decode() for s in value.numpy().reshape(-1)]
    return tf.make_ndarray(tensor)


def _files(graph, nodes):
    for node in graph.node:
        if node.op == "Identity" and node.name.startswith("FileIdentity"):
            value = _const(nodes, node.input[0])
            if value is not None:
                return list(value)
    return None


def _last_batch(nodes, output):
    """(batch_size, drop_remainder) of the last `batch`, or (None, None)."""
    node = nodes.get(_name(output))
    while node is not None:
        if node.op in _BATCHES:
            size = _const(nodes, node.input[1])
            drop = _const(nodes, node.input[-1])
            return (None if size is None else int(size),
                    bool(drop) if drop is not None else False)
        node = nodes.get(_name(node.input[0])) if node.input else None
    return None, None


def _unseeded(nodes, node):
    seeds = [_const(nodes, ref) for ref in node.input[2:4]]
    return len(seeds) == 2 and all(s is not None and int(s) == 0
                                   for s in seeds)


def inspect(dataset):
    """The `Pipeline` facts of `dataset`."""
    graph = _compat.dataset_graph(dataset)
    nodes = {n.name: n for n in graph.node}
    ops = [n.op for n in graph.node] + [
        n.op for f in graph.library.function for n in f.node_def]
    hint = any(n.op == "ShardDataset" and _is_hint(nodes, n)
               for n in graph.node)
    output = next((n.input[0] for n in graph.node if n.op == "_Retval"),
                  graph.node[-1].name)
    batch_size, drop = _last_batch(nodes, output)
    shuffles = [n.op for n in graph.node
                if n.op in _SHUFFLES and _unseeded(nodes, n)]
    return Pipeline(_files(graph, nodes), bool(READERS.intersection(ops)),
                    hint, batch_size, drop, shuffles)


def _is_hint(nodes, node):
    values = [_const(nodes, ref) for ref in node.input[1:3]]
    return all(v is not None and int(v) == _SHARD_HINT for v in values)
