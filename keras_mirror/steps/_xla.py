"""XLA per replica: the replica's forward pass, loss and gradients compiled.

`jit_compile` follows the user's compile of the wrapped model
(`model.compile(jit_compile=...)` or `mirrored.compile(...)`, which calls
it): Keras resolves `"auto"` there with its own single-device rule (True on
a machine with a GPU when every layer supports XLA, False on CPU-only
machines), and the public `model.jit_compile` holds the result. The wrapper's
own train function stays uncompiled: it holds the gradient all-reduce and
the optimizer update, which XLA cannot compile (collectives, and the
optimizer's `merge_call` on the `"strategy"` path). Inside it, each replica
calls one `tf.function(jit_compile=True)` holding that replica's forward
pass, loss, loss scaling and gradients, on both execution paths.

Where it cannot run, the step runs uncompiled and says so once (decided
in `_one_trace.decide`): a masked output (its shares need every replica's count
of unmasked entries, an all-reduce), BatchNormalization with global
statistics (an all-reduce inside the forward pass), and a model's own
`train_step` (its optimizer's `apply` all-reduces inside the user's step).
"""

import keras
import tensorflow as tf

MASKED = ("the model's output carries a Keras mask, whose loss shares need "
          "every replica's count of unmasked entries (an all-reduce)")
OWN_STEP = (
    "the model has its own `train_step`, whose optimizer `apply` "
    "all-reduces the gradients inside the step. Compile the parts of your "
    "step that hold no optimizer call yourself (e.g. the forward pass and "
    "`tape.gradient` in a `tf.function(jit_compile=True)`); they then run "
    "compiled on every replica")


OTHER_STATE = ("the loss or the forward pass updates variables that are not "
               "the model's (a multi-output model's per-output loss "
               "trackers, a layer's own state kept outside the model), "
               "whose updates a function of the model's values would drop")


def replica_function(model, body, jit_compile, note):
    """One function of a replica's work, for every replica (XLA: default).

    `body(*args)` runs the forward pass and returns `(outputs, loss to
    differentiate)`. The compiled function takes the model's variable
    values, not its variables (XLA cannot read a variable placed on another
    device, and a function that captures no variable serves every replica
    from one trace): `f(trainable, non_trainable, *args)` returns
    `(outputs, gradients, non-trainable values after the pass)`, computed
    in a `keras.StatelessScope` as Keras's own `stateless_call` does.
    A pass that updates any other variable calls `note(OTHER_STATE)` while
    tracing (`_one_trace.note`: its updates would be dropped, so that trace
    is not used).
    """
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    known = {id(v) for v in trainable + non_trainable}

    def work(t_values, nt_values, *args):
        mapping = list(zip(trainable, t_values)) + list(
            zip(non_trainable, nt_values))
        with tf.GradientTape() as tape:
            tape.watch(t_values)
            with keras.StatelessScope(state_mapping=mapping,
                                      collect_losses=True) as scope:
                outputs, loss = body(*args)
                updates = [scope.get_current_value(v) for v in non_trainable]
            if set(scope.state_mapping) - known:
                note(OTHER_STATE)
        grads = tape.gradient(loss, t_values)
        return outputs, grads, updates

    return tf.function(work, jit_compile=jit_compile, autograph=False)


def remember(mirrored, function):
    """Keeps the last traced replica function (its trace count is tested)."""
    mirrored._step_state.xla_last = function
    return function


def values(variables):
    """The variables' current values, read once, outside XLA."""
    return [tf.identity(v.value) for v in variables]


def assign(variables, new_values):
    for v, value in zip(variables, new_values):
        v.assign(value)
