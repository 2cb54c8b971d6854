"""`keras_mirror/_compat/_base.py`: one test per private attribute.

Each fails loudly when Keras or TensorFlow renames or removes what it
checks.
"""

import keras
import pytest

from keras_mirror import _compat


def test_supported_keras_version():
    _compat.check_keras_version()


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
        with _compat.replaced_method(opt, "_no_such_hook", lambda f: f,
                                     "hook", "a test"):
            pass


# -- every replacement, recorded and listed ----------------------------------

LOSSES = {"keras.src.losses.loss.scale_loss_for_distribution",
          "keras.src.losses.loss.unscale_loss_for_distribution"}
DRAWS = {f"keras.src.backend.tensorflow.random.{name}"
         for name in _compat.RANDOM_FUNCTIONS + ("draw_seed",)}
# While mirrored (`_homes`), and in the update traced once.
MIRRORED = {"keras.optimizers.Optimizer._distribution_strategy",
            "keras.Variable._value",
            "keras.optimizers.Optimizer._trainable_variables_indices"} | {
    f"tensorflow.python.distribute.values.MirroredVariable.__{name}__"
    for name in ("int", "float", "complex")}
ONE_UPDATE = {"tf.__internal__.distribute.interim.maybe_merge_call",
              "tf.__internal__.distribute.strategy_supports_no_merge_call"}
BUILT_IN = LOSSES | DRAWS | MIRRORED | ONE_UPDATE | {
    "keras.optimizers.Optimizer._all_reduce_sum_gradients"}


def _recorded(cpus, build, x, y=None, **compile_kwargs):
    """What `MirroredModel(model).fit` replaces, from wrapping to the end.
    """
    import keras_mirror

    model = build()
    with _compat.recording() as seen:
        mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
        mirrored.fit(x, y, batch_size=6, epochs=1, verbose=0)
    return seen


def _mlp(*middle, outputs=1):
    def build():
        inputs = keras.Input((4,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        for layer in middle:
            h = layer(h)
        heads = [keras.layers.Dense(1)(h) for _ in range(outputs)]
        model = keras.Model(inputs, heads if outputs > 1 else heads[0])
        losses = ["mse", keras.losses.MeanSquaredError(reduction="sum")]
        model.compile("adam", losses[:outputs] if outputs > 1 else "mse",
                      metrics=[["mae"]] * outputs if outputs > 1 else ["mae"])
        return model

    return build


def test_a_plain_model_replaces_only_losses_draws_and_the_update(cpus):
    import numpy as np

    x = np.random.rand(12, 4).astype("float32")
    y = np.random.rand(12, 1).astype("float32")
    seen = _recorded(cpus, _mlp(keras.layers.Dropout(0.2)), x, y)
    assert seen == BUILT_IN
    seen = _recorded(cpus, _mlp(keras.layers.BatchNormalization()), x, y)
    assert seen - BUILT_IN == {
        "keras.src.backend.tensorflow.nn._compute_moments"}
    seen = _recorded(cpus, _mlp(keras.layers.BatchNormalization(
        synchronized=True)), x, y)
    assert seen - BUILT_IN == {
        "keras.src.backend.tensorflow.nn._compute_moments_sync"}


def test_outputs_of_other_kinds_replace_their_loss_list_and_trackers(cpus):
    import numpy as np

    x = np.random.rand(12, 4).astype("float32")
    y = np.random.rand(12, 1).astype("float32")
    seen = _recorded(cpus, _mlp(outputs=2), x, (y, y))
    assert seen - BUILT_IN == {
        "keras.src.trainers.compile_utils.CompileLoss._flat_losses",
        "keras.metrics.Metric.update_state"}


class Tracked(keras.Model):
    """An own `train_step` with a loss tracker and a clipping optimizer,
    and an own `fit` that calls Keras's."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    def fit(self, *args, **kwargs):
        return super().fit(*args, **kwargs)


def test_an_own_step_replaces_its_hooks_metrics_and_routing(cpus):
    import numpy as np

    def build():
        model = Tracked()
        model.compile(keras.optimizers.SGD(0.1, clipnorm=1.0))
        model(np.zeros((1, 4), "float32"))
        return model

    x = np.random.rand(12, 4).astype("float32")
    y = np.random.rand(12, 1).astype("float32")
    seen = _recorded(cpus, build, x, y)
    assert seen == LOSSES | DRAWS | MIRRORED | ONE_UPDATE | {
        "tf.GradientTape.gradient",
        "keras.optimizers.Optimizer._all_reduce_sum_gradients",
        # Recorded before the replicas run (the optimizer was not built),
        # then applying the global gradient in the replicas' step.
        "keras.optimizers.Optimizer.apply",
        "keras.metrics.Metric.update_state", "keras.metrics.Metric.result",
        "keras.Model.fit"}


def test_each_replacement_carries_its_reason(cpus):
    import numpy as np

    x = np.random.rand(12, 4).astype("float32")
    y = np.random.rand(12, 1).astype("float32")
    seen = _recorded(cpus, _mlp(keras.layers.BatchNormalization()), x, y)
    assert set(seen.reasons) == seen
    assert all(isinstance(r, str) and r for r in seen.reasons.values())
    with pytest.raises(ValueError, match="needs its reason"):
        with _compat.replaced(keras.layers, {"Dense": None}, reason=""):
            pass
    assert keras.layers.Dense.__name__ == "Dense"


def _listed():
    """The labels in `docs/architecture.md`'s list of replacements
    (`prefix.{a, b}` is `prefix.a` and `prefix.b`)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" /
            "architecture.md").read_text()
    section = text.split("### Keras and TF attributes keras-mirror "
                         "replaces")[1].split("\n## ")[0]
    labels = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            prefix, _, names = name.partition("{")
            for part in (names.rstrip("}").split(",") if names else [""]):
                labels.add(prefix + part.strip())
    return labels


def test_the_architecture_list_names_each_recorded_replacement():
    listed = _listed()
    every = BUILT_IN | {
        "keras.src.backend.tensorflow.nn._compute_moments",
        "keras.src.backend.tensorflow.nn._compute_moments_sync",
        "keras.src.trainers.compile_utils.CompileLoss._flat_losses",
        "keras.metrics.Metric.update_state", "keras.metrics.Metric.result",
        "keras.optimizers.Optimizer.apply", "tf.GradientTape.gradient"}
    assert every <= listed, sorted(every - listed)
    routed = {f"keras.Model.{name}" for name in (
        "fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
        "predict_on_batch")}
    assert listed - every == routed
