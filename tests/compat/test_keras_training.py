"""`keras_mirror/_compat/keras_training.py`: one test per private attribute.

Each fails loudly when Keras or TensorFlow renames or removes what it
checks.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror import _compat


def _dense_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_optimizer_allreduce_hook_exists_and_is_used():
    opt = keras.optimizers.SGD(1.0)
    assert callable(getattr(opt, _compat._ALLREDUCE_HOOK))
    var = keras.Variable(np.zeros(2, "float32"))
    seen = []

    def make_hook(original):
        def hook(grads_and_vars):
            seen.append(len(list(grads_and_vars)))
            return [(g * 2.0, v) for g, v in grads_and_vars]
        return hook

    with _compat.replace_optimizer_allreduce(opt, make_hook, "a test"):
        opt.apply([tf.ones(2)], [var])
    assert seen == [1]
    np.testing.assert_allclose(var.numpy(), [-2.0, -2.0])
    assert _compat._ALLREDUCE_HOOK not in vars(opt)  # restored


def test_disable_optimizer_allreduce():
    opt = keras.optimizers.SGD(1.0)
    pairs = [(tf.ones(1), None)]
    with _compat.disable_optimizer_allreduce(opt):
        assert getattr(opt, _compat._ALLREDUCE_HOOK)(pairs) == pairs
    assert _compat._ALLREDUCE_HOOK not in vars(opt)


def test_loss_tracker_is_the_loss_mean():
    model = _dense_model()
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    assert tracker.name == "loss"
    assert _compat.loss_tracker(keras.Sequential()) is None


def test_compile_metrics_is_the_compiled_metrics_container():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0)
    container = _compat.compile_metrics(model)
    assert isinstance(container, keras.metrics.Metric)
    assert any(m is container for m in model.metrics)
    assert _compat.compile_metrics(keras.Sequential()) is None


def test_loss_scalers_exist_and_divide_by_replicas(cpus):
    module = _compat._loss_module()
    for name in _compat._LOSS_SCALERS:
        assert callable(getattr(module, name))
    strategy = tf.distribute.MirroredStrategy(cpus[:2])
    loss = keras.losses.MeanSquaredError()
    y = tf.ones((2, 1))

    def step():
        return loss(y, tf.zeros((2, 1)))

    scaled = strategy.experimental_local_results(strategy.run(step))[0]
    with _compat.unscaled_losses():
        plain = strategy.experimental_local_results(strategy.run(step))[0]
    assert float(scaled) == pytest.approx(0.5)
    assert float(plain) == pytest.approx(1.0)
    # Restored afterwards.
    again = strategy.experimental_local_results(strategy.run(step))[0]
    assert float(again) == pytest.approx(0.5)


def test_symbolic_build_exists():
    assert callable(getattr(keras.Model, _compat._SYMBOLIC_BUILD))


def test_output_loss_trackers_and_compiled_checks():
    a = keras.Input((2,))
    model = keras.Model(a, [keras.layers.Dense(1, name="p")(a),
                            keras.layers.Dense(1, name="q")(a)])
    assert not _compat.has_compiled_loss_or_metrics(model)
    model.compile("sgd", ["mse", "mse"])
    assert _compat.has_compiled_loss_or_metrics(model)
    model.fit(np.zeros((2, 2)), [np.zeros((2, 1))] * 2, verbose=0)
    trackers = _compat.output_loss_trackers(model)
    assert [t.name for t in trackers] == ["p_loss", "q_loss"]
    assert all(isinstance(t, keras.metrics.Mean) for t in trackers)


def test_flat_losses_report_each_outputs_value():
    a = keras.Input((2,))
    model = keras.Model(a, [keras.layers.Dense(1, name="p")(a),
                            keras.layers.Dense(1, name="q")(a)])
    assert _compat.flat_losses(model) is None
    model.compile("sgd", ["mse", keras.losses.MeanAbsoluteError(
        reduction="sum")], loss_weights=[1.0, 0.5])
    model.fit(np.zeros((2, 2)), [np.ones((2, 1))] * 2, verbose=0)
    entries = _compat.flat_losses(model)
    assert [e.name for e in entries] == ["p", "q"]
    assert [e.loss_weights for e in entries] == [1.0, 0.5]
    seen = []
    x = np.ones((3, 2), "float32")
    y_pred = model(x)
    with _compat.reporting_flat_losses(model, lambda i, v: seen.append(i)):
        total = model.compute_loss(x=x, y=[np.ones((3, 1))] * 2,
                                   y_pred=y_pred)
    assert seen == [0, 1]
    assert _compat.flat_losses(model) is entries  # restored
    assert float(total) > 0


def test_keras_per_sample_loss_knows_the_builtins():
    def own(y_true, y_pred):
        return keras.ops.sum(y_pred)

    class Own(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return y_pred

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0)
    assert _compat.keras_per_sample_loss(_compat.flat_losses(model)[0].loss)
    assert _compat.keras_per_sample_loss(
        keras.losses.MeanSquaredError(reduction="sum"))
    assert not _compat.keras_per_sample_loss(Own())
    model.compile("sgd", own)
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0)
    assert not _compat.keras_per_sample_loss(
        _compat.flat_losses(model)[0].loss)


def test_loss_owners_name_the_add_loss_layers():
    class Adds(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(x))
            return x

    a = keras.Input((2,))
    model = keras.Model(a, Adds(name="adds")(keras.layers.Dense(2)(a)))
    model(np.ones((1, 2), "float32"))
    assert _compat.loss_owners(model) == ["layer 'adds'"]
    assert len(model.losses) == 1


def test_layers_within_reach_an_rnn_cell():
    cell = keras.layers.SimpleRNNCell(3, name="cell")
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.RNN(cell)])
    layers = _compat.layers_within(model)
    assert layers[0] is model
    assert any(layer is cell for layer in layers)
    assert not any(layer is cell for layer in model.layers)


def test_optimizer_trainables_are_what_it_was_built_on():
    """An optimizer's `apply` without variables (and EMA) updates the
    variables it was built on, in `_trainable_variables`; a
    `LossScaleOptimizer` holds them too."""
    a = keras.Variable(np.zeros(2, "float32"))
    b = keras.Variable(np.zeros(3, "float32"))
    opt = keras.optimizers.SGD(1.0)
    assert _compat.optimizer_trainables(opt) == []
    opt.build([a, b])
    assert _compat.optimizer_trainables(opt) == [a, b]
    opt.apply([tf.ones(2), tf.ones(3)])
    np.testing.assert_allclose(b.numpy(), -np.ones(3))
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    scaled.build([a])
    assert _compat.optimizer_trainables(scaled) == [a]
    assert _compat.optimizer_trainables(scaled.inner_optimizer) == [a]


def test_initial_epoch_is_where_fit_starts():
    # `BackupAndRestore` sets it on the (user's) model; `fit` starts there.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert getattr(model, _compat.INITIAL_EPOCH) is None
    setattr(model, _compat.INITIAL_EPOCH, 2)
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=3,
                        verbose=0)
    assert history.epoch == [2]


def test_updates_in_place_replace_the_optimizers_merge_call():
    """Keras's TF optimizer updates through
    `tf.__internal__.distribute.interim.maybe_merge_call`; in the block it
    calls its function with the stand-in distribution, whose
    `extended.update(var, fn, ...)` is `fn(var, ...)`, and the original
    comes back afterwards."""
    import inspect

    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    source = inspect.getsource(tf_optimizer.TFOptimizer)
    assert source.count(f"interim.{_compat._MERGE_CALL}(") >= 2
    module = tf.__internal__.distribute.interim
    original = getattr(module, _compat._MERGE_CALL)
    seen = []

    def fn(distribution, value):
        return distribution.extended.update(
            "var", lambda var, x: seen.append((var, x)) or x + 1,
            args=(value,), group=False)

    with _compat.updates_in_place(keras.optimizers.SGD()):
        assert module.maybe_merge_call(fn, object(), 41) == 42
    assert seen == [("var", 41)]
    assert getattr(module, _compat._MERGE_CALL) is original
    # A real update under the stand-in: once, on the variable as given.
    variable = keras.Variable(np.ones(2, "float32"))
    opt = keras.optimizers.SGD(0.5)
    with _compat.updates_in_place(opt):
        opt.apply([tf.ones(2)], [variable])
    np.testing.assert_allclose(variable.numpy(), [0.5, 0.5])


def test_distributes_through_writes_every_mirrored_copy(cpus):
    """EMA's overwrite and `SwapEMAWeights` update each variable through the
    optimizer's `_distribution_strategy`; in the block it is the given
    strategy (a `LossScaleOptimizer`'s inner one's too), so that a
    `MirroredVariable`'s every copy is written, and afterwards it is the
    one the optimizer was made with."""
    import inspect

    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    source = inspect.getsource(
        tf_optimizer.TFOptimizer._overwrite_model_variables_with_average_value)
    assert "self._distribution_strategy.extended.update(" in source
    swap = inspect.getsource(keras.callbacks.SwapEMAWeights)
    assert "optimizer._distribution_strategy.extended.update(" in swap
    strategy = tf.distribute.MirroredStrategy(cpus[:2])
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, use_ema=True))
    made_with = opt.inner_optimizer._distribution_strategy
    with _compat.distributes_through(opt, strategy):
        with strategy.scope():  # the slots colocate through it too
            variable = keras.Variable(np.ones(2, "float32"))
            opt.build([variable])
        assert isinstance(variable.value, tf.distribute.DistributedValues)
        assert opt._distribution_strategy is strategy
        inner = opt.inner_optimizer
        assert inner._distribution_strategy is strategy
        for average in inner._model_variables_moving_average:
            average.assign(np.full(2, 0.25, "float32"))
        inner.finalize_variable_values([variable])
    for copy in strategy.experimental_local_results(variable.value):
        np.testing.assert_allclose(np.array(copy), [0.25, 0.25])
    assert opt.inner_optimizer._distribution_strategy is made_with
    assert opt._distribution_strategy is made_with
