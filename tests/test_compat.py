"""One test per private Keras attribute in `keras_mirror/_compat.py`.

A Keras release that renames or changes one of them fails here, by name,
instead of silently mis-weighting gradients elsewhere.
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


def test_supported_keras_version():
    _compat.check_keras_version()


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

    _compat.replace_optimizer_allreduce(opt, make_hook)
    opt.apply([tf.ones(2)], [var])
    assert seen == [1]
    np.testing.assert_allclose(var.numpy(), [-2.0, -2.0])


def test_disable_optimizer_allreduce():
    opt = keras.optimizers.SGD(1.0)
    _compat.disable_optimizer_allreduce(opt)
    pairs = [(tf.ones(1), None)]
    assert getattr(opt, _compat._ALLREDUCE_HOOK)(pairs) == pairs


def test_loss_tracker_is_the_loss_mean():
    model = _dense_model()
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    assert tracker.name == "loss"
    assert _compat.loss_tracker(keras.Sequential()) is None


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


def _collective_base():
    import importlib

    module = importlib.import_module(_compat._TF_COLLECTIVE_MODULE)
    return getattr(module, _compat._TF_COLLECTIVE_EXTENDED)


def test_multi_worker_device_hook_exists_and_is_called():
    import inspect

    base = _collective_base()
    hook = getattr(base, _compat._TF_LOCAL_DEVICES_HOOK)
    assert list(inspect.signature(hook).parameters) == [
        "self", "cluster_resolver", "worker_device"]
    # TensorFlow's constructor asks the hook for the worker's devices.
    source = inspect.getsource(base)
    assert f"self.{_compat._TF_LOCAL_DEVICES_HOOK}(" in source
    extended = _compat.collective_extended_on("CPU", [2, 0])
    assert issubclass(extended, base)
    devices, kind = getattr(extended, _compat._TF_LOCAL_DEVICES_HOOK)(
        None, None, "/job:worker/task:1")
    assert devices == ("/job:worker/task:1/device:CPU:2",
                       "/job:worker/task:1/device:CPU:0")
    assert kind == "CPU"


def test_multi_worker_strategy_keeps_its_worker_device():
    import inspect

    # Set in `CollectiveAllReduceExtended._initialize_multi_worker`; read
    # by `_compat.worker_device` (the multi-worker tests run it for real).
    source = inspect.getsource(_collective_base())
    assert f"self.{_compat._TF_WORKER_DEVICE} = " in source
    fake = type("S", (), {"extended": type(
        "E", (), {_compat._TF_WORKER_DEVICE: "/job:worker/task:3"})()})()
    assert _compat.worker_device(fake) == "/job:worker/task:3"


def test_masks_are_read_and_set_on_tensors_and_reach_losses():
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(
        tf.constant([[1, 0, 2]]))
    np.testing.assert_array_equal(_compat.get_mask(embedded),
                                  [[True, False, True]])
    assert _compat.get_mask(tf.zeros((1, 3))) is None
    # A mask set by `set_mask` is the one Keras's losses divide by.
    y_pred = tf.constant([[[1.0], [5.0], [3.0]]])
    _compat.set_mask(y_pred, tf.constant([[True, False, True]]))
    assert _compat.get_mask(y_pred) is not None
    value = keras.losses.MeanSquaredError()(tf.zeros((1, 3, 1)), y_pred)
    # Unmasked entries only: (1 + 9) / 2.
    assert float(value) == pytest.approx(5.0)


# -- attributes added for wrapping in place and exact randomness -----------


def test_variable_backing_can_be_replaced_and_restored(cpus):
    v = keras.Variable(np.arange(3, dtype="float32"))
    plain = _compat.backing(v)
    assert isinstance(plain, tf.Variable)
    strategy = tf.distribute.MirroredStrategy(cpus[:2])
    with strategy.scope():
        mirrored = _compat.new_backing(v, plain.read_value())
    assert _compat.backing(v) is plain  # not installed by new_backing
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    _compat.set_backing(v, mirrored)
    np.testing.assert_array_equal(v.numpy(), [0, 1, 2])
    _compat.set_backing(v, plain)
    assert _compat.backing(v) is plain


def test_random_module_has_the_replaced_functions():
    module = _compat.random_module()
    for name in _compat.RANDOM_FUNCTIONS + ("_cast_seed", "draw_seed"):
        assert callable(getattr(module, name))
    # keras.random reaches them through the module at call time.
    calls = []
    original = module.normal

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    with _compat.replaced(module, {"normal": spy}):
        keras.random.normal((2,), seed=1)
    assert len(calls) == 1
    assert module.normal is original


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


def test_clip_hook_exists_and_is_used():
    opt = keras.optimizers.SGD(1.0, clipnorm=1.0)
    var = keras.Variable(np.zeros(2, "float32"))
    seen = []

    def make_hook(original):
        def clip(grads):
            seen.append(len(grads))
            return original(grads)
        return clip

    _compat.replace_optimizer_clip(opt, make_hook)
    opt.apply([tf.constant([3.0, 4.0])], [var])
    assert seen == [1]
    np.testing.assert_allclose(var.numpy(), [-0.6, -0.8], rtol=1e-6)


def test_rekey_optimizer_follows_a_new_backing(cpus):
    var = keras.Variable(np.zeros(2, "float32"))
    opt = keras.optimizers.Adam(0.1)
    opt.build([var])
    _compat.set_backing(var, _compat.new_backing(var, tf.ones(2)))
    with pytest.raises(ValueError, match="Unknown variable"):
        opt.apply([tf.ones(2)], [var])
    _compat.rekey_optimizer(opt)
    opt.apply([tf.ones(2)], [var])
    assert int(opt.iterations) == 1
def test_other_backend_is_refused_at_construction(monkeypatch):
    import keras_mirror

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError) as info:
        keras_mirror.MirroredModel(model)
    assert str(info.value) == (
        "keras-mirror needs Keras's TensorFlow backend (it trains on "
        "`tf.distribute`). Set `KERAS_BACKEND=tensorflow` (or "
        '`"backend": "tensorflow"` in ~/.keras/keras.json) before importing '
        "Keras. Received: keras.backend.backend()='jax'")


def test_a_missing_private_name_fails_loudly_by_name():
    with pytest.raises(RuntimeError, match=r"has no `Variable\._value`; "
                       r"keras-mirror cannot move it\. Install a supported "
                       r"Keras"):
        _compat._require(object(), ("_value",), "Variable", "move it")
    opt = keras.optimizers.SGD()
    with pytest.raises(RuntimeError, match=r"SGD\._no_such_hook"):
        _compat._replace_method(opt, "_no_such_hook", lambda f: f, "hook")


def test_initial_epoch_is_where_fit_starts():
    # `BackupAndRestore` sets it on the (user's) model; `fit` starts there.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert getattr(model, _compat.INITIAL_EPOCH) is None
    setattr(model, _compat.INITIAL_EPOCH, 2)
    history = model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=3,
                        verbose=0)
    assert history.epoch == [2]
