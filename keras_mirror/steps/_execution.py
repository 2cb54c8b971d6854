"""The execution path a `MirroredModel` runs, and why.

`pick` is called once, in `MirroredModel.__init__`; `describe` is the
one-line account that `summary()` and `execution_summary` show.
"""

import warnings

EXECUTIONS = ("auto", "in_graph", "strategy")


def check(execution, what):
    if execution == "in_graph":
        raise ValueError(
            f"`execution='in_graph'` cannot run {what}: only the "
            "tf.distribute path can. Pass execution='strategy' or 'auto'. "
            f"Received: execution={execution!r}")


def collective_options(bytes_per_pack, communication):
    """The collective all-reduce options given away from their defaults."""
    return {k: v for k, v in (("bytes_per_pack", bytes_per_pack),
                              ("communication", communication))
            if v != {"bytes_per_pack": 0, "communication": "auto"}[k]}


def pick(execution, devices, spec, custom_step, collective_options,
         synchronized=()):
    """Returns (path, reason) for `MirroredModel(execution=...)`."""
    if spec is not None:
        return "strategy", "training spans a multi-worker cluster"
    if custom_step:
        check(execution, "a model with its own `train_step`")
        if execution == "strategy":
            return "strategy", "execution='strategy' was asked for"
        return "strategy", ("the model has its own `train_step`, which runs "
                            "per replica under the strategy")
    if synchronized and len(devices) > 1:
        check(
            execution, "`BatchNormalization(synchronized=True)` (layers "
            f"{list(synchronized)}), whose statistics need every replica's "
            "rows at once")
        if execution != "strategy":
            return "strategy", (
                "the model has synchronized BatchNormalization, whose "
                "statistics are all-reduced across the replicas")
    if execution == "strategy":
        return "strategy", "execution='strategy' was asked for"
    given = ", ".join(f"{k}={v!r}" for k, v in collective_options.items())
    if execution == "in_graph":
        if collective_options:
            raise ValueError(
                f"{given} tune the collective all-reduce of the "
                "'strategy' execution path; the 'in_graph' path sums "
                "gradients in-graph and has no collective. Drop them or "
                "pass execution='strategy'. Received: "
                f"execution='in_graph', {given}")
        return "in_graph", "execution='in_graph' was asked for"
    if collective_options:
        return "strategy", (f"collective all-reduce options were given "
                            f"({given})")
    if len(devices) == 1:
        return "in_graph", "there is one device (nothing to mirror)"
    if all("CPU" in d.upper() for d in devices):
        return "in_graph", ("the devices are CPUs of one host, which share "
                            "memory: mirrored copies would only add an "
                            "optimizer update per copy")
    return "strategy", ("the devices are accelerators: each keeps its own "
                        "copy and gradients are all-reduced (NCCL on GPUs)")


def describe(execution, reason, devices, strategy):
    """One line: which execution path runs, and why."""
    if execution == "in_graph":
        what = ("in_graph (one graph; each replica's shard runs under "
                "tf.device on its device; one copy of the variables on "
                f"{devices[0]}; gradients summed in-graph)")
    else:
        what = (f"strategy (tf.distribute "
                f"{type(strategy).__name__}; one replica step per "
                "device; explicit gradient all-reduce)")
    return f"{what}, because {reason}."


def warn_unused_timeout(execution, timeout_seconds):
    """`timeout_seconds` bounds collectives, which `"in_graph"` has none of."""
    if execution == "in_graph" and timeout_seconds is not None:
        warnings.warn(
            "`timeout_seconds` has no effect on the 'in_graph' execution "
            "path, which sums gradients in one graph without a collective "
            "to time out. Pass execution='strategy' to bound the "
            "all-reduce, or drop it. "
            f"Received: timeout_seconds={timeout_seconds!r} with "
            "execution='in_graph'", UserWarning, stacklevel=3)
