"""The user's own variables, trained in place on a `tf.distribute` strategy.

`MirroredModel` never copies the user's model: the object passed in is the
object that trains. On the `"strategy"` path each of its variables (the
model's, seed generators' included, and every optimizer's) gets a second,
distributed backing variable made inside the strategy's scope, with the value
kept (`_compat.new_backing`). `VariableHomes.mirrored()` switches every
variable to its distributed backing for the duration of a wrapper call
(`fit`, `evaluate`, ...), copying the current values in and releasing the
single-device backing (so that weights and optimizer state are not kept
twice on the first device), and back to a new single-device backing
afterwards, made from the trained values. So:

- `mirrored.model is model`, and it holds the live weights during and after
  training (a callback reading `model.get_weights()` sees the step's);
- the user's own `model.fit`, `predict`, `save` keep working on one device
  between wrapper calls, on the trained weights;
- code that updates a variable through its optimizer's strategy
  (`SwapEMAWeights`, EMA's overwrite at the end of `fit`) writes every
  copy, as under stock Keras with the optimizer made in the scope;
- the wrapper's traced step functions keep the same distributed variables
  from call to call (no retracing), and a variable created during a wrapper
  call (an optimizer's slots) gets its single-device twin on the way out.

Metric variables are not moved: the steps update them outside the replicas
(or, in a model's own `train_step`, from every replica into the one copy).
"""

import contextlib

import keras
import tensorflow as tf

from keras_mirror import _compat


def optimizers_of(model):
    """The model's optimizers: `model.optimizer` and any held as attributes.

    A GAN keeps `d_optimizer` and `g_optimizer`; a `LossScaleOptimizer`
    counts once (its inner optimizer's variables are among its own).
    """
    found = []

    def add(item):
        if isinstance(item, keras.optimizers.Optimizer) and not any(
                item is f for f in found):
            found.append(item)

    add(getattr(model, "optimizer", None))
    for value in list(vars(model).values()):
        items = value if isinstance(value, (list, tuple)) else (
            value.values() if isinstance(value, dict) else (value,))
        for item in items:
            add(item)
    return found


def unique(variables):
    """`variables` in order, each once (a variable shared by sub-models)."""
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _distributed(tf_variable):
    return isinstance(tf_variable, tf.distribute.DistributedValues)


def _python_scalar(convert):
    def method(self):
        return convert(self.read_value().numpy())

    method.__name__ = f"__{convert.__name__}__"
    return method


_SCALARS = ("`int(model.optimizer.iterations)` (a Keras variable converts "
            "through its backing) works while mirrored as on one device")


def _scalar_conversions(cls):
    """Within the block, a distributed variable class has `int()`,
    `float()` and `complex()` (those it lacks), through the seam
    (`_compat.replaced`).

    A Keras variable converts to a Python scalar through its backing
    (`int(self.value)`): TensorFlow's variable converts its value, but its
    `MirroredVariable` has no such method and raises `TypeError`. So a
    callback reading `int(self.model.optimizer.iterations)` or
    `float(self.model.some_counter)` during `mirrored.fit` would crash
    where plain `fit` works. The methods read the value as TensorFlow's
    variable does (the first replica's copy outside a replica); they are
    the class's only while the wrapper's variables are mirrored.
    """
    missing = {f"__{c.__name__}__": _python_scalar(c)
               for c in (int, float, complex)
               if not hasattr(cls, f"__{c.__name__}__")}
    return _compat.replaced(cls, missing, _SCALARS,
                            label=f"{cls.__module__}.{cls.__name__}")


class VariableHomes:
    """Keeps each Keras variable's single-device and distributed backings."""

    def __init__(self, model, strategy):
        self._model = model
        self._strategy = strategy
        self._entries = {}  # id -> [keras variable, single, distributed]
        self._depth = 0
        # While mirrored: what `_enter` replaced (`_seam`), left by `_exit`.
        self._seam = None
        self._converted = set()

    def variables(self):
        """Every variable that moves: the model's, its optimizers' and the
        state of Keras's global seed generator (unseeded `keras.random`
        draws), which every replica then reads and advances as one."""
        return unique(list(self._model.variables) + [
            v for opt in optimizers_of(self._model) for v in opt.variables]
            + [_compat.made_global_seed_generator().state])

    def _enter(self):
        for v in self.variables():
            entry = self._entries.setdefault(id(v), [v, None, None])
            current = _compat.backing(v)
            if _distributed(current):
                entry[2] = current
                continue
            entry[1] = current
            if entry[2] is None:
                with self._strategy.scope():
                    entry[2] = _compat.new_backing(v, current.read_value())
            else:
                entry[2].assign(current.read_value())
            _compat.set_backing(v, entry[2])
            self._convertible(type(entry[2]))
            # No second copy of the weights on the first device while the
            # mirrored copy trains: the idle backing is released, and made
            # again from the trained value on the way out.
            entry[1] = None
        self._forget_traced_functions()
        self._rekey()

    def _convertible(self, cls):
        """`_scalar_conversions` of `cls`, until the variables go home."""
        if cls not in self._converted:
            self._converted.add(cls)
            self._seam.enter_context(_scalar_conversions(cls))

    def _forget_traced_functions(self):
        """Drops the user's model's traced functions, which hold backings.

        Keras's `train_function` (and test, predict) captured the released
        single-device variables; the model's own next `fit` traces again, on
        the backings `_exit` makes.
        """
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(self._model, name, None) is not None:
                setattr(self._model, name, None)

    def _rekey(self):
        for optimizer in optimizers_of(self._model):
            _compat.rekey_optimizer(optimizer)

    def _exit(self):
        for v in self.variables():
            entry = self._entries.setdefault(id(v), [v, None, None])
            current = _compat.backing(v)
            if not _distributed(current):
                continue
            entry[2] = current
            value = current.read_value()
            if entry[1] is None:
                with tf.init_scope():
                    entry[1] = _compat.new_backing(v, value)
            else:
                entry[1].assign(value)
            _compat.set_backing(v, entry[1])
        self._rekey()

    def refresh(self):
        """Moves variables created during a wrapper call (none outside)."""
        if self._depth:
            self._enter()

    @contextlib.contextmanager
    def mirrored(self):
        """Within the block the variables are the strategy's (re-entrant),
        and the optimizers update through it, as optimizers made in its
        scope do (`_compat.distributes_through`)."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with contextlib.ExitStack() as seam:
            for optimizer in optimizers_of(self._model):
                seam.enter_context(
                    _compat.distributes_through(optimizer, self._strategy))
            self._seam = seam
            try:
                self._enter()
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                    self._exit()
            finally:
                self._seam, self._converted = None, set()
