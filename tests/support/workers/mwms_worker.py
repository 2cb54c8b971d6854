"""A real `MultiWorkerMirroredStrategy` worker for the launcher tests.

Builds the strategy (which waits until every peer has joined), calls
`keras_mirror.launch.mark_ready()`, all-reduces a 1 across the cluster and
prints the sum.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __name__ == "__main__":  # not when a test imports this module
    import _lean  # noqa: F401  (beside this script: before Keras)
import tensorflow as tf  # noqa: E402

from keras_mirror import launch  # noqa: E402


def main():
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    launch.mark_ready()

    @tf.function
    def step():
        context = tf.distribute.get_replica_context()
        return context.all_reduce("sum", tf.constant(1.0))

    total = strategy.experimental_local_results(strategy.run(step))[0]
    print(f"all-reduce sum={float(total):g}", flush=True)


if __name__ == "__main__":
    main()
