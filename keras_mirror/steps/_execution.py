"""The one execution path a `MirroredModel` runs, and why.

Every device kind, cluster and model (Keras's built-in step or its own
`train_step`) runs the same replica step on `tf.distribute`:
`MirroredStrategy` on one host, `MultiWorkerMirroredStrategy` across hosts.
Logical CPUs in tests and CI run exactly the code that GPUs run.
`reason` is called once, in `MirroredModel.__init__`; `describe` is the
one-line account that `summary()` and `execution_summary` show.
"""

EXECUTIONS = ("auto", "strategy")
REMOVED = {
    "in_graph": (
        "`execution='in_graph'` was removed in keras-mirror 0.2: every "
        "device now runs the one `tf.distribute` path, the code GPUs and "
        "clusters run. Omit `execution` (or pass execution='auto' or "
        "'strategy')."),
}


def check(execution):
    """Refuses a removed `execution` value, naming the replacement."""
    if isinstance(execution, str) and execution in REMOVED:
        raise ValueError(
            f"{REMOVED[execution]} Received: execution={execution!r}")


def reason(execution, devices, spec):
    """Why the one path runs, for `MirroredModel(execution=...)`."""
    if spec is not None:
        return "training spans a multi-worker cluster"
    if execution == "strategy":
        return "execution='strategy' was asked for"
    if len(devices) == 1:
        return "it is the one path; one device runs it as one replica"
    return ("it is the one path, on every device kind: each replica keeps "
            "its own copy of the variables and gradients are all-reduced "
            "(NCCL on GPUs)")


def describe(reason, strategy):
    """One line: which execution path runs, and why."""
    what = (f"strategy (tf.distribute {type(strategy).__name__}; one "
            "replica step per device; explicit gradient all-reduce)")
    return f"{what}, because {reason}."
