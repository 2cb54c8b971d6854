"""A real `MultiWorkerMirroredStrategy` worker for the launcher tests.

Builds the strategy (which waits until every peer has joined), calls
`keras_mirror.launch.mark_ready()`, all-reduces a 1 across the cluster and
prints the sum. It then leaves with its peers (`_finish.exit_together`,
beside its ready file), not through TensorFlow's shutdown, which waits on
the coordination service's heartbeats. Should it still be running after
`STACKS_AFTER` seconds, it writes every thread's Python stack to stderr
(which the launcher prefixes with `[worker i]`), so that a hang in a CI run
shows where it waits (one CI run timed out after the workers were ready).
"""

import faulthandler
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __name__ == "__main__":  # not when a test imports this module
    import _lean  # noqa: F401  (beside this script: before Keras)
import tensorflow as tf  # noqa: E402

from keras_mirror import launch  # noqa: E402

STACKS_AFTER = 40


def main():
    faulthandler.dump_traceback_later(STACKS_AFTER, exit=False,
                                      file=sys.stderr)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    launch.mark_ready()

    @tf.function
    def step():
        context = tf.distribute.get_replica_context()
        return context.all_reduce("sum", tf.constant(1.0))

    total = strategy.experimental_local_results(strategy.run(step))[0]
    print(f"all-reduce sum={float(total):g}", flush=True)
    resolver = strategy.cluster_resolver
    ready_file = os.environ.get(launch.READY_FILE_ENV)
    if ready_file:
        import _finish  # beside this script
        _finish.exit_together(pathlib.Path(ready_file).parent,
                              resolver.task_id,
                              resolver.cluster_spec().num_tasks("worker"))


if __name__ == "__main__":
    main()
