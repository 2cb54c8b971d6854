"""What TensorFlow allows a function traced once for N replicas to hold.

Prints, for a `MirroredStrategy` over 4 logical CPUs inside a
`tf.function` step:

- how often a `tf.function` called in every replica of `strategy.run` is
  traced (TensorFlow retraces per device), and a `ConcreteFunction` (once);
- where the ops of a `ConcreteFunction` traced once run (each replica's
  call on its own device, the replica id given as a tensor);
- whether `ReplicaContext.all_reduce` and `merge_call` (what an
  optimizer's `apply` does under a strategy) may run inside it.

    python benchmarks/one_trace_limits.py
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402


def _strategy(n=4):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    return tf.distribute.MirroredStrategy(devices)


def _try(strategy, fn):
    @tf.function
    def step():
        return strategy.run(fn, args=(tf.ones([2]),))

    try:
        out = strategy.experimental_local_results(step())
        calls = [op.device.split("/")[-1] for op in
                 step.get_concrete_function().graph.get_operations()
                 if op.type == "PartitionedCall"]
        return ("runs, replica results " + " ".join(
            f"{float(t[0]):g}" for t in out)
            + (f", calls on {' '.join(calls)}" if calls else ""))
    except RuntimeError as e:
        return str(e).splitlines()[-1].strip()[:110]


def main():
    strategy = _strategy()
    traces = []

    def work(x, r):
        traces.append(1)
        return x * 2.0 + tf.cast(r, tf.float32)

    function = tf.function(work, autograph=False)

    def replica_id():
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    print("tf.function in every replica:",
          _try(strategy, lambda x: function(x, replica_id())),
          f"(traces: {len(traces)})")
    del traces[:]
    concrete = tf.function(work, autograph=False).get_concrete_function(
        tf.TensorSpec([None]), tf.TensorSpec([], tf.int32))
    print("ConcreteFunction in every replica:",
          _try(strategy, lambda x: concrete(x, replica_id())),
          f"(traces: {len(traces)})")
    all_reduce = tf.function(
        lambda x: tf.distribute.get_replica_context().all_reduce("sum", x),
        autograph=False)
    print("all_reduce inside it:",
          _try(strategy, lambda x: all_reduce(x)))
    merge = tf.function(
        lambda x: tf.distribute.get_replica_context().merge_call(
            lambda s, v: s.reduce("sum", v, axis=None), args=(x,)),
        autograph=False)
    print("merge_call inside it:", _try(strategy, lambda x: merge(x)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
