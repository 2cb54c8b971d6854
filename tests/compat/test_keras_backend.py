"""`keras_mirror/_compat/keras_backend.py`: one test per private attribute.

Each fails loudly when Keras or TensorFlow renames or removes what it
checks.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mirror import _compat


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


def test_compute_output_spec_builds_a_model_without_running_it():
    class Counting(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)
            self.calls = self.add_variable(shape=(), initializer="zeros",
                                           trainable=False)

        def call(self, x):
            self.calls.assign_add(1.0)
            return self.dense(x)

    model = Counting()
    spec = _compat.compute_output_spec(
        model, keras.KerasTensor((3, 4), "float32"), training=False)
    assert tuple(spec.shape) == (3, 2)
    assert model.built and model.dense.kernel.shape == (4, 2)
    assert float(model.calls) == 0.0


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

    with _compat.replaced(module, {"normal": spy}, reason="a spy"):
        keras.random.normal((2,), seed=1)
    assert len(calls) == 1
    assert module.normal is original


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


@pytest.mark.parametrize("name,kwargs", [
    ("SYNC_MOMENTS", {"synchronized": True}), ("LOCAL_MOMENTS", {})])
def test_moments_module_calls_the_moments_by_name(name, kwargs):
    import tensorflow as tf

    module = _compat.moments_module()
    calls = []
    attribute = getattr(_compat, name)
    original = getattr(module, attribute)

    def spy(x, axes, keepdims):
        calls.append(axes)
        return original(x, axes, keepdims)

    with _compat.replaced(module, {attribute: spy}, reason="a spy"):
        mean, _ = module.moments(tf.ones((3, 2)), [0], **kwargs)
    assert calls == [[0]]
    assert mean.numpy().tolist() == [1.0, 1.0]


def test_new_backing_keeps_the_tf_trainable_flag_of_the_current_backing():
    # A layer built trainable, frozen, then unfrozen: its backing stays
    # `trainable=True` (what TensorFlow's tape watches), and so must a new
    # backing made while the layer is frozen.
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    layer.trainable = False
    kernel = layer.kernel
    made = _compat.new_backing(kernel, kernel.numpy())
    assert made.trainable is True
    assert kernel.trainable is False  # the Keras flag is left as it was
    assert _compat.backing(kernel) is not made


def test_the_global_seed_generator_is_made_as_keras_would():
    """Made once, found where Keras's unseeded draws look, with Python's
    `random` state kept (its seed is the one Keras would have drawn)."""
    import random

    keras.utils.set_random_seed(3)
    assert _compat.global_seed_generator() is None
    before = random.getstate()
    made = _compat.made_global_seed_generator()
    assert random.getstate() == before
    assert _compat.made_global_seed_generator() is made
    assert _compat.global_seed_generator() is made
    keras.utils.set_random_seed(3)
    keras.random.normal((1,))  # Keras makes its own, from the same state
    seed = made.state.numpy()   # and advances it once, unordered
    np.testing.assert_array_equal(
        _compat.global_seed_generator().state.numpy(),
        (seed + 1) * 5387 % 933199)
