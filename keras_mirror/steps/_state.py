"""The step machinery's own state, in one object the wrapper owns.

`MirroredModel` holds one `StepState` (`mirrored._step_state`), set once
when wrapping and never tracked by Keras (a plain object is no layer,
variable or container): what the step decided, why, and what it traced
last. No module writes step state into the wrapper's `__dict__`.
"""

import dataclasses
import weakref


@dataclasses.dataclass
class StepState:
    """What the built-in step decided while tracing, and why.

    Attributes:
        one_trace_off: why a replica's work is traced per replica instead
            of once for all (None: traced once where it can be).
        one_trace_last: the last `_one_trace.Traced` (its trace count).
        one_update_reason: why the optimizer's update was last applied as
            stock Keras applies it (None: traced once for all replicas).
        one_update_last: the last `_one_update.Update`.
        xla_off: why the replica step runs without XLA although asked.
        xla_last: the last XLA-compiled replica function.
        stateful_warned: whether stateful TF random draws were warned about.
        scanned_graphs: the graphs already scanned for them.
        said: the `(what, reason)` pairs already logged or warned about.
        output_masked: whether the last traced step's outputs carry a
            Keras mask (gathered with it).
        reductions: the kinds of the loss terms (`_reductions.Reductions`;
            None: to be classified, `_probing`; reset by each compile).
        capacity: the split capacity of `"per_replica"` batches
            (`_capacity`; None: the balanced split of a global batch).
        last_replica_logs: the last step's `replica_*` vectors
            (`callbacks/_replica_stats.remember`).
        batchnorm: the model's BatchNorm `_batchnorm.Kinds` (None: to be
            decided; reset by each compile).
        adopted: the model's compile state the wrapper last adopted
            (`wrapper/_compile`; None: not yet).
    """

    one_trace_off: str = None
    one_trace_last: object = None
    one_update_reason: str = None
    one_update_last: object = None
    xla_off: str = None
    xla_last: object = None
    stateful_warned: bool = False
    scanned_graphs: weakref.WeakSet = dataclasses.field(
        default_factory=weakref.WeakSet)
    said: set = dataclasses.field(default_factory=set)
    output_masked: bool = False
    batchnorm: object = None
    reductions: object = None
    capacity: int = None
    last_replica_logs: dict = None
    adopted: object = None

    def first_time(self, what, reason):
        """True the first time `(what, reason)` is to be said, else False:
        each decision is logged or warned about once per wrapper."""
        if (what, reason) in self.said:
            return False
        self.said.add((what, reason))
        return True
