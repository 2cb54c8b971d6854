"""Routes each Keras step to the replica step it runs.

`StepDispatch` is the step half of `MirroredModel`: Keras calls its
`train_step`, `test_step` and `predict_step`, which go to the model's own
step (`own_step`) or Keras's built-in one (`strategy.ReplicaSteps`, the
base class). Both run under the same runner, on `tf.distribute`, on every
device kind; neither imports this module.
"""

from keras_mirror.distribute import _worker_input
from keras_mirror.steps import _one_trace
from keras_mirror.steps import _probing
from keras_mirror.steps import _replica_stats
from keras_mirror.steps import own_step
from keras_mirror.steps import strategy


class StepDispatch(strategy.ReplicaSteps):
    """The Keras step methods of `MirroredModel`, one path per wrapper."""

    def _stat_keys(self):
        """The built-in step's `replica_*` statistics, in packed order.

        Read when the step is traced (as `on_nonfinite` is).
        """
        if self._replica_stats:
            return _replica_stats.STAT_KEYS
        if self.on_nonfinite != "warn":
            return ("replica_nonfinite",)
        return ()

    @property
    def metrics(self):
        """The wrapped model's metrics (Keras resets them every epoch)."""
        inner = self.__dict__.get("_inner")
        if inner is None or not getattr(inner, "compiled", False):
            return super().metrics
        return inner.metrics

    def train_step(self, data):
        data = _worker_input.assemble(self, data)
        if self._custom_step:
            _one_trace.decide(self)  # says once why XLA does not run
            return own_step.train_step(self, data)
        return super().train_step(data)

    def make_train_function(self, force=False):
        """Keras's train function, returning the `replica_*` vectors.

        The built-in step packs its per-replica statistics into one tensor
        (`_replica_stats.PACKED`); the returned function splits it, so every
        caller of `train_function` (fit, train_on_batch) sees the vectors,
        and keeps them for `last_replica_logs`. `train_on_batch` and the
        callbacks that did not opt in see plain Keras's keys only.
        """
        if self.train_function is not None and not force:
            return self.train_function
        super().make_train_function(force=force)
        self.train_function = _probing.first_call(
            self, _replica_stats.unpacking(self.train_function,
                                          self._stat_keys(), owner=self))
        return self.train_function

    def make_test_function(self, force=False):
        """Keras's test function; its first call classifies the loss terms
        on its first batch (`_probing`), as the train function's does."""
        if self.test_function is not None and not force:
            return self.test_function
        super().make_test_function(force=force)
        self.test_function = _probing.first_call(self, self.test_function,
                                                 training=False)
        return self.test_function

    def test_step(self, data):
        if own_step.overrides(self._inner, "test_step"):
            return own_step.test_step(self, data)
        return super().test_step(data)

    def predict_step(self, data):
        if own_step.overrides(self._inner, "predict_step"):
            return own_step.predict_step(self, data)
        return super().predict_step(data)
