"""The one seam: keras-mirror leaves Keras and TensorFlow as it found them.

Every replacement of a Keras or TF attribute goes through
`_compat.replaced` (`keras_mirror/_compat/_base.py`), entered around the
replicas' step or while the wrapper's variables are mirrored, and left
after. Here: every class and module keras-mirror patches (their own
attributes, each the very object it was) and the hook names on the
wrapped model's own optimizers and metrics are as before after `fit`,
`evaluate`, `predict`, `save`, a step that raises, and the wrapper's
deletion; and a plain Keras model training in another thread while a
wrapped one traces trains as alone, seeing TF's own `tape.gradient`.
"""

import gc
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import values as tf_values

import keras_mirror
from keras_mirror import _compat

# The names keras-mirror may set on an optimizer or metric of the user's.
HOOKS = ("_all_reduce_sum_gradients", "_clip_gradients", "apply",
         "_distribution_strategy", "update_state", "result")
# Made by Python itself: a class's `__annotations__` on its first read (3.10+),
# a module's record of the warnings it gave.
LAZY = ("__annotations__", "__warningregistry__")


def _patched_owners(model):
    """Every class and module keras-mirror replaces in, by label."""
    import importlib

    from keras_mirror.steps import _random  # noqa: F401 (loads the module)

    classes = {tf.GradientTape, tf_values.DistributedVariable,
               tf_values.MirroredVariable, tf_values.SyncOnReadVariable,
               keras.metrics.Metric, keras.metrics.Mean,
               type(_compat.made_global_seed_generator().state)}
    for cls in (type(model), keras.Model, type(model.optimizer),
                keras.optimizers.LossScaleOptimizer):
        classes.update(c for c in cls.__mro__ if c is not object)
    modules = [importlib.import_module(name) for name in (
        _compat._LOSS_MODULE, "keras.src.backend.tensorflow.random",
        "keras.src.backend.tensorflow.nn",
        "keras.src.trainers.compile_utils", "keras.src.losses.losses")]
    modules += [tf.__internal__.distribute,
                tf.__internal__.distribute.interim]
    owners = {f"{c.__module__}.{c.__qualname__}": c for c in classes}
    owners.update({m.__name__: m for m in modules})
    return owners


def _snapshot(owners, objects):
    """Each owner's own attributes (the objects), and the hook names set
    on each object (`objects`: the user's optimizers and metrics)."""
    own = {label: {k: v for k, v in vars(owner).items() if k not in LAZY}
           for label, owner in owners.items()}
    hooks = {id(o): {k: vars(o)[k] for k in HOOKS if k in vars(o)}
             for o in objects}
    return own, hooks


def _assert_same(before, after, when):
    for (label, was), now in zip(before[0].items(), after[0].values()):
        assert was.keys() == now.keys(), (when, label,
                                           was.keys() ^ now.keys())
        changed = [k for k in was if was[k] is not now[k]]
        assert not changed, (when, label, changed)
    for key, was in before[1].items():
        now = after[1][key]
        assert was.keys() == now.keys() and all(
            was[k] is now[k] for k in was), (when, was, now)


class Raising(keras.Model):
    """An own `train_step` (clipping optimizer, a per-row target, a
    tracker) that raises on the step after `raise_after` steps."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.tracker = keras.metrics.Mean(name="loss")
        self.calls = 0
        self.raise_after = None

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        self.calls += 1
        if self.raise_after is not None and self.calls > self.raise_after:
            raise RuntimeError("a step that raises")
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x) - y) ** 2, axis=-1)  # per row
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        self.tracker.update_state(keras.ops.mean(loss))
        return {"loss": self.tracker.result()}


def _built_in():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(h)
    model = keras.Model(inputs, [keras.layers.Dense(1)(h),
                                 keras.layers.Dense(1)(h)])
    model.compile(keras.optimizers.Adam(clipnorm=1.0),
                  ["mse", keras.losses.MeanSquaredError(reduction="sum")],
                  metrics=[["mae"], ["mae"]])
    return model


def _own_step():
    model = Raising()
    model.compile(keras.optimizers.SGD(0.1, clipnorm=1.0))
    model(np.zeros((1, 4), "float32"))
    return model


@pytest.mark.parametrize("build", [_built_in, _own_step])
def test_every_patched_class_and_module_is_left_as_found(cpus, tmp_path,
                                                         build):
    x = np.random.rand(12, 4).astype("float32")
    y = np.random.rand(12, 1).astype("float32")
    model = build()
    targets = y if isinstance(model, Raising) else (y, y)
    objects = [model.optimizer] + list(model.metrics)
    owners = _patched_owners(model)
    before = _snapshot(owners, objects)
    mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
    mirrored.fit(x, targets, batch_size=6, epochs=1, verbose=0)
    _assert_same(before, _snapshot(owners, objects), "fit")
    if isinstance(model, Raising):
        assert keras.ops.ndim(model.tracker.result()) == 0
    else:
        mirrored.evaluate(x, targets, batch_size=6, verbose=0)
        _assert_same(before, _snapshot(owners, objects), "evaluate")
        mirrored.predict(x, batch_size=6, verbose=0)
        _assert_same(before, _snapshot(owners, objects), "predict")
        mirrored.save(str(tmp_path / "model.keras"))
        _assert_same(before, _snapshot(owners, objects), "save")
    # A step that raises: traced, in the replicas' trace; run eagerly, on
    # the second step, after one step trained.
    if isinstance(model, Raising):
        for eagerly, raise_after in ((False, 0), (True, 2)):
            model.compile(keras.optimizers.SGD(0.1, clipnorm=1.0),
                          run_eagerly=eagerly)
            objects = [model.optimizer] + list(model.metrics)
            before = _snapshot(owners, objects)
            model.calls, model.raise_after = 0, raise_after
            with pytest.raises(RuntimeError, match="a step that raises"):
                mirrored.fit(x, y, batch_size=6, epochs=1, verbose=0)
            assert model.calls == raise_after + 1  # 2 replicas a step
            _assert_same(before, _snapshot(owners, objects),
                         f"a raising step (eagerly={eagerly})")
    del mirrored
    gc.collect()
    _assert_same(before, _snapshot(owners, objects), "deleted")
    # The user's optimizer still finds every slot (its index follows the
    # variables' new backings), and the user's own `fit` trains.
    model.raise_after = None
    model.compile(run_eagerly=False, optimizer=model.optimizer,
                  **({} if isinstance(model, Raising) else {
                      "loss": ["mse", "mse"]}))
    model.fit(x, targets, batch_size=6, epochs=1, verbose=0)


def test_a_scalar_conversion_holds_only_while_mirrored(cpus):
    seen = []

    class Reads(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(int(self.model.optimizer.iterations))

    model = _built_in()
    mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
    x = np.random.rand(12, 4).astype("float32")
    y = np.random.rand(12, 1).astype("float32")
    mirrored.fit(x, (y, y), batch_size=6, epochs=1, verbose=0,
                 callbacks=[Reads()])
    assert seen == [1, 2]
    for name in ("__int__", "__float__", "__complex__"):
        assert name not in vars(tf_values.MirroredVariable)


# -- a plain Keras model in another thread -----------------------------------


def _plain(initial=None):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    if initial is not None:
        model.set_weights(initial)
    return model


def _per_row_gradient():
    """A per-row target's gradient in a `tf.function` whose rows are
    unknown: TF's own sum over rows (keras-mirror's replacement would
    scale it inside a replica)."""
    w = tf.Variable(tf.ones((3, 1)))

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def gradient(x):
        with tf.GradientTape() as tape:
            target = tf.matmul(x, w)
        return tape.gradient(target, w)

    return gradient(tf.reshape(tf.range(12, dtype=tf.float32), (4, 3)))


def test_a_plain_model_in_another_thread_trains_as_alone(cpus):
    original = tf.GradientTape.gradient
    x = np.random.RandomState(0).rand(64, 3).astype("float32")
    y = np.random.RandomState(1).rand(64, 1).astype("float32")
    initial = _plain().get_weights()
    alone = _plain(initial)
    alone.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    expected_gradient = _per_row_gradient().numpy()

    tracing, finished = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        try:
            assert tracing.wait(300), "the wrapped model never traced"
            seen["replaced"] = tf.GradientTape.gradient is not original
            seen["gradient"] = _per_row_gradient().numpy()
            beside = _plain(initial)
            beside.fit(x, y, batch_size=16, epochs=3, shuffle=False,
                       verbose=0)
            seen["weights"] = beside.get_weights()
        except BaseException as error:  # noqa: BLE001 - reported below
            seen["error"] = error
        finally:
            finished.set()

    class Waits(Raising):
        def train_step(self, data):
            in_replica = keras_mirror.replica_context().distributed
            if in_replica and not tracing.is_set():
                tracing.set()  # the tape's replacement is in place now
                assert finished.wait(300), "the other thread hung"
            return super().train_step(data)

    model = Waits()
    model.compile(keras.optimizers.SGD(0.1))
    model(np.zeros((1, 4), "float32"))
    mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
    thread = threading.Thread(target=other_thread)
    thread.start()
    mirrored.fit(np.random.rand(12, 4).astype("float32"),
                 np.random.rand(12, 1).astype("float32"), batch_size=6,
                 epochs=1, verbose=0)
    thread.join(300)
    assert "error" not in seen, seen.get("error")
    assert seen["replaced"], "the other thread did not run while tracing"
    np.testing.assert_array_equal(seen["gradient"], expected_gradient)
    for a, b in zip(seen["weights"], alone.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert tf.GradientTape.gradient is original
