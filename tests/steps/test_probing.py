"""Loss reductions classified on real rows, each output on its own (issue 24).

Each test trains the same model on one device and through `MirroredModel`
over 4 logical CPUs from the same `tf.data` input, on both execution paths,
and asserts equal weights (1e-5) and equal logs, per output too.

Also the tests of `keras_mirror/steps/_reductions.py` and
`keras_mirror/steps/_loss_kinds.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import max_diff

import keras_mirror
from keras_mirror.steps import dispatch

pytestmark = pytest.mark.usefixtures("execution")


def _mlp(loss, outputs=2, spe=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(outputs)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss,
                  steps_per_execution=spe)
    return model


def _data(rows=50, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = rng.normal(size=(rows, 2)).astype("float32")
    return x, y


def _both(make, ds, epochs=2, **kwargs):
    """(one device's model and history, the wrapper and its history)."""
    single = make()
    single_history = single.fit(ds, epochs=epochs, verbose=0, **kwargs)
    mirrored = keras_mirror.MirroredModel(make())
    history = mirrored.fit(ds, epochs=epochs, verbose=0, **kwargs)
    return single, single_history.history, mirrored, history.history


def _assert_same_logs(expected, logs):
    for key, values in expected.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-5,
                                   err_msg=key)


def test_sum_reduction_from_a_dataset_is_exact():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    make = lambda: _mlp(keras.losses.MeanSquaredError(reduction="sum"))  # noqa
    single, expected, mirrored, logs = _both(make, ds, validation_data=ds)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    assert mirrored._step_state.reductions.outputs == ("sum",)
    _assert_same_logs(expected, logs)


def test_masked_model_from_a_dataset_is_classified_and_exact():
    """On zeros `Embedding(mask_zero=True)` masks everything (NaN)."""
    rng = np.random.default_rng(0)
    x = rng.integers(1, 20, size=(50, 7)).astype("int32")
    x[:, 5:] = 0
    y = rng.normal(size=(50, 1)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((7,), dtype="int32"),
            keras.layers.Embedding(20, 4, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    single, expected, mirrored, logs = _both(make, ds)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    assert mirrored._step_state.reductions.outputs == ("mean",)
    _assert_same_logs(expected, logs)


def _two_outputs(reductions):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, {
        "a": keras.layers.Dense(2, name="a")(hidden),
        "b": keras.layers.Dense(1, name="b")(hidden)})
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss={"a": keras.losses.MeanSquaredError(reduction=reductions[0]),
              "b": keras.losses.MeanAbsoluteError(reduction=reductions[1])},
        loss_weights={"a": 1.0, "b": 0.5})
    return model


def _two_output_data():
    x, y = _data()
    rng = np.random.default_rng(3)
    targets = {"a": y, "b": rng.normal(size=(50, 1)).astype("float32")}
    return tf.data.Dataset.from_tensor_slices((x, targets)).batch(14)


@pytest.mark.parametrize("reductions,kinds", [
    (("sum", "sum"), ("sum", "sum")),
    (("sum", "sum_over_batch_size"), ("sum", "mean")),
])
def test_each_output_is_trained_and_logged_by_its_own_reduction(
        reductions, kinds):
    ds = _two_output_data()
    single, expected, mirrored, logs = _both(
        lambda: _two_outputs(reductions), ds, validation_data=ds)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    assert mirrored._step_state.reductions.outputs == kinds
    assert {"a_loss", "b_loss", "val_a_loss", "val_b_loss"} <= set(expected)
    _assert_same_logs(expected, logs)
    np.testing.assert_allclose(
        list(mirrored.evaluate(ds, verbose=0, return_dict=True).values()),
        list(single.evaluate(ds, verbose=0, return_dict=True).values()),
        rtol=1e-5)


def test_evaluate_first_classifies_on_its_own_first_batch():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single = _mlp(keras.losses.MeanSquaredError(reduction="sum"))
    mirrored = keras_mirror.MirroredModel(
        _mlp(keras.losses.MeanSquaredError(reduction="sum")))
    np.testing.assert_allclose(mirrored.evaluate(ds, verbose=0),
                               single.evaluate(ds, verbose=0), rtol=1e-5)
    assert mirrored._step_state.reductions.outputs == ("sum",)


def test_a_builtin_loss_that_is_zero_on_the_first_batch_goes_by_reduction():
    """0 on the batch and on it twice decides nothing: the built-in loss's
    `reduction` does, never a default of "mean"."""
    x, y = _data()
    x[:14] = 0.0
    y[:14] = 0.0  # zero predictions (zero inputs, zero biases), zero loss

    def make():
        model = _mlp(keras.losses.MeanSquaredError(reduction="sum"))
        return model

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single, expected, mirrored, logs = _both(make, ds)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    assert mirrored._step_state.reductions.outputs == ("sum",)


def test_a_custom_loss_that_is_zero_on_the_first_batch_trains():
    """0 with a 0 gradient decides nothing: weighted as a mean, warned
    about by name, never refused (issue 38)."""

    class Squares(keras.losses.Loss):  # per-sample: a batch mean
        def call(self, y_true, y_pred):
            return keras.ops.mean(keras.ops.square(y_pred - y_true), -1)

    x, y = _data(45)
    x[:14] = 0.0
    y[:14] = 0.0  # zero predictions (zero inputs, zero biases), zero loss
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    make = lambda: _mlp(Squares(name="squares"))  # noqa: E731
    with pytest.warns(UserWarning, match=r"The loss of output 'squares' and "
                      r"its gradient are 0 or not finite on the first batch "
                      r".*weighted as a batch mean. Received: loss=squares"):
        single, expected, mirrored, logs = _both(make, ds)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    _assert_same_logs(expected, logs)


@pytest.mark.parametrize("spe", [1, 3])
def test_the_probe_reuses_the_first_batch_and_traces_the_step_once(
        spe, monkeypatch):
    traced = []
    original = dispatch.StepDispatch.train_step

    def counting(self, data):
        traced.append(1)
        return original(self, data)

    monkeypatch.setattr(dispatch.StepDispatch, "train_step", counting)
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    # A loss of the user's own: its kind is probed on the first batch.
    make = lambda: _mlp(_own_sum, spe=spe)  # noqa
    probes = _counting_probes(monkeypatch)
    single, expected, mirrored, logs = _both(make, ds)
    assert len(probes) == 1
    assert len(traced) == 1
    assert int(mirrored.optimizer.iterations) == int(
        single.optimizer.iterations) == 8
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    _assert_same_logs(expected, logs)


def _own_sum(y_true, y_pred):
    return keras.ops.sum(keras.ops.square(y_true - y_pred))


def _counting_probes(monkeypatch):
    """The list the loss-term probe appends to each time it runs."""
    from keras_mirror.steps import _loss_terms

    probes, evaluate = [], _loss_terms.evaluate

    def counting(*args, **kwargs):
        probes.append(1)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(_loss_terms, "evaluate", counting)
    return probes


class _OwnIdentity(keras.layers.Layer):
    def call(self, x):
        return x


class _OwnCell(keras.layers.Layer):
    """A SimpleRNN cell of the user's, held only as an `RNN`'s `cell`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = 2
        self.dense = keras.layers.Dense(2)

    def call(self, x, states):
        out = self.dense(keras.ops.concatenate([x, states[0]], axis=-1))
        return out, [out]


def _builtin_net(reduction="sum", **dense):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu", **dense),
        keras.layers.Dropout(0.3), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.MeanSquaredError(reduction=reduction))
    return model


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_builtin_losses_and_layers_train_exactly_without_a_probe(
        reduction, monkeypatch):
    """Keras's own losses and layers: the kinds come from the losses'
    `reduction`, and the first step reads no batch ahead to probe."""
    probes = _counting_probes(monkeypatch)
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    make = lambda: _builtin_net(  # noqa
        reduction, kernel_regularizer=keras.regularizers.L2(0.01))
    single, expected, mirrored, logs = _both(make, ds, validation_data=ds)
    assert probes == []
    kind = "sum" if reduction == "sum" else "mean"
    assert mirrored._step_state.reductions.outputs == (kind,)
    assert mirrored._step_state.reductions.extras == ("mean",)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    _assert_same_logs(expected, logs)


@pytest.mark.parametrize("layer", ["own_layer", "own_rnn_cell",
                                   "activity_regulariser"])
def test_a_layer_that_may_add_a_loss_is_probed(layer, monkeypatch):
    probes = _counting_probes(monkeypatch)
    inner = {
        "own_layer": lambda: _OwnIdentity(),
        "own_rnn_cell": lambda: keras.Sequential([
            keras.layers.Reshape((3, 2)),
            keras.layers.RNN(_OwnCell()), keras.layers.Dense(8)]),
        "activity_regulariser": lambda: keras.layers.Dense(
            8, activity_regularizer=keras.regularizers.L1(0.01)),
    }[layer]

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), inner(),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single, expected, mirrored, logs = _both(make, ds)
    assert probes == [1]
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5


@pytest.mark.parametrize("execution", [None], ids=["no_step"])
def test_the_known_kinds_are_the_probed_kinds():
    """Every scalar built-in reduction, a loss weighted 0, sample-weighted
    means and weight regularisation: `known` says what the probe measures
    (`reduction="none"` alone: `test_reductions_none.py`)."""
    from keras_mirror.steps import _loss_kinds

    keras.utils.set_random_seed(0)
    a = keras.Input((6,))
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1),
        bias_regularizer=keras.regularizers.L1(0.1))(a)
    names = ["sum", "sum_over_batch_size", "mean", "mean_with_sample_weight",
             "zero_weight"]
    model = keras.Model(a, [keras.layers.Dense(2, name=n)(hidden)
                            for n in names])
    losses = [keras.losses.MeanSquaredError(reduction=n) for n in names[:-1]]
    model.compile(optimizer="sgd",
                  loss=losses + [keras.losses.Huber(reduction="sum")],
                  loss_weights=[1.0] * (len(names) - 1) + [0.0])
    x, _ = _data(12)
    y = [np.ones((12, 2), "float32")] * len(names)
    sw = [np.linspace(0.5, 2.0, 12).astype("float32")] * len(names)
    model.evaluate(x, y, sample_weight=sw, verbose=0)  # builds the loss
    probed = _loss_kinds.probe(model, (x, y, sw))
    known = _loss_kinds.known(model)
    assert known.outputs == probed.outputs
    assert known.extras == probed.extras == ("mean", "mean")
    assert known.compiled == probed.compiled


def test_an_empty_dataset_ends_as_in_keras(monkeypatch):
    """A filtered dataset that yields nothing: Keras's "ran out of data"
    warning and an empty history, probed or not."""
    ds = tf.data.Dataset.from_tensor_slices(_data()).filter(
        lambda a, b: False).batch(14)
    for make in (_builtin_net, lambda: _mlp(_own_sum)):
        for model in (make(), keras_mirror.MirroredModel(make())):
            with pytest.warns(UserWarning, match="ran out of data"):
                history = model.fit(ds, epochs=1, verbose=0)
            assert history.history == {}
            assert model.evaluate(ds, verbose=0) == []


def test_add_loss_sum_and_zero_initialised_regulariser():
    """An `add_loss` batch sum is weighted 1; a bias regulariser that is 0
    at first (zeros) is weight regularisation, classified statically."""

    class SumPenalty(keras.layers.Layer):
        def call(self, x):
            self.add_loss(0.01 * keras.ops.sum(keras.ops.square(x)))
            return x

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh",
                               bias_regularizer=keras.regularizers.L2(0.1)),
            SumPenalty(), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single, expected, mirrored, logs = _both(make, ds)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    assert mirrored._step_state.reductions.extras == ("sum", "mean")
    _assert_same_logs(expected, logs)


# The probe runs before any step, on one device: one path is enough.
@pytest.mark.parametrize("execution", [None], ids=["before_any_step"])
def test_the_probe_never_warns_of_retracing(caplog):
    from keras_mirror.steps import _loss_kinds

    x, y = _data(8)
    model = _mlp("mse")
    model.train_on_batch(x, y)  # built, as `fit` builds it before the probe
    batch = (tf.constant(x), tf.constant(y), None)
    # Five probes in a process (five wrappers): TensorFlow's "triggered
    # tf.function retracing" warning came at five traced calls in a row.
    caplog.clear()
    with caplog.at_level("WARNING", logger="tensorflow"):
        kinds = [_loss_kinds.probe(model, batch) for _ in range(5)]
    assert [(k.outputs, k.extras) for k in kinds] == [(("mean",), ())] * 5
    assert "retracing" not in caplog.text


# -- issue 38: nothing Keras's fit would not run, no tolerance a sum misses --


class _MetricInComputeLoss(keras.Model):
    """Keras's `test_metric_update_in_compute_loss`, with an activity
    regulariser read in `compute_loss` (`test_fwd_pass_loss_presence_...`).
    """

    def __init__(self):
        super().__init__(name="metric_in_compute_loss")
        self.custom = keras.metrics.Mean(name="custom")
        self.forward = keras.metrics.Mean(name="forward")
        self.hidden = keras.layers.Dense(8, activation="tanh",
                                         activity_regularizer="l2")
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
        if not in_symbolic_scope():  # as Keras's own test asserts it
            assert training, "compute_loss called with training=False"
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom.update_state(loss * 4)
        self.forward.update_state(sum(self.losses))
        return loss


def test_a_metric_updated_in_compute_loss_counts_what_keras_counts():
    def make():
        keras.utils.set_random_seed(0)
        model = _MetricInComputeLoss()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    x, y = _data(45)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single, expected, mirrored, logs = _both(make, ds, epochs=1)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    for name in ("custom", "forward"):
        mine = getattr(mirrored.model, name)
        theirs = getattr(single, name)
        for a, b in zip(mine.variables, theirs.variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                       err_msg=f"{name}/{a.name}")
    # Four batches, each counted once (14, 14, 14 and 3 rows).
    assert float(mirrored.model.custom.count.numpy()) == pytest.approx(4.0)
    _assert_same_logs(expected, logs)


class _Sum(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.sum(y_pred) + 0.0 * keras.ops.sum(y_true)


def test_a_batch_sum_of_normalised_outputs_is_a_sum():
    """Its value is float noise (~1e-6), its gradient is not."""
    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2), keras.layers.GroupNormalization(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=_Sum(name="batch_sum"))
        return model

    x, y = _data(45)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single, expected, mirrored, logs = _both(make, ds)
    assert mirrored._step_state.reductions.outputs == ("sum",)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5


class _Penalty(keras.layers.Layer):
    def __init__(self, reduce, training_only=False, **kwargs):
        super().__init__(**kwargs)
        self.reduce = reduce
        self.training_only = training_only

    def call(self, x, training=None):
        if self.training_only and not training:
            return x
        # Reduced in the layer's dtype (float16 under mixed_float16).
        self.add_loss(keras.ops.cast(
            0.01 * self.reduce(keras.ops.square(x)), "float32"))
        return x


def test_a_mixed_float16_batch_sum_is_a_sum():
    """A float16 batch sum whose doubled batch overflows (inf) is judged
    by its gradient, which does not."""
    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(64, dtype="mixed_float16"),
            _Penalty(keras.ops.sum, dtype="mixed_float16"),
            keras.layers.Dense(2, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(1e-5), loss="mse")
        return model

    x, y = _data(45)
    ds = tf.data.Dataset.from_tensor_slices((x * 19, y)).batch(14)
    single, expected, mirrored, logs = _both(make, ds)
    assert mirrored._step_state.reductions.extras == ("sum",)
    assert np.isfinite(expected["loss"]).all()
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5


@pytest.mark.parametrize("execution", [None], ids=["no_step"])
@pytest.mark.parametrize("once,twice,kind", [
    ((620.0, [1.0, 2.0]), (1241.0, [2.0, 4.0]), "sum"),  # float16 rounding
    ((1e-6, [3.0, -1.0]), (-2e-6, [6.0, -2.0]), "sum"),  # normalised
    ((5.0, [1.0]), (5.0004, [1.0001]), "mean"),
    ((5.0, []), (np.inf, []), "undecided"),
    ((0.0, [0.0, 0.0]), (0.0, [0.0, 0.0]), "undecided"),
    ((4.0, [1.0]), (6.0, [1.5]), None),  # half a sum, half a mean
])
def test_the_nearer_kind_wins_and_zero_is_undecided(once, twice, kind):
    from keras_mirror.steps import _loss_kinds

    as_arrays = lambda t: (t[0], np.array(t[1]))  # noqa: E731
    assert _loss_kinds._kind(as_arrays(once), as_arrays(twice)) == kind


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean"])
def test_every_reduction_with_dropout_weights_and_add_loss_terms(reduction):
    """Forward passes run with training=True, as `fit` runs them: a term
    added in training only is classified too, Dropout draws in the probe,
    and a sum is still a sum."""
    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh",
                                    activity_regularizer="l2")(inputs)
        hidden = keras.layers.Dropout(0.3, seed=4)(hidden)
        hidden = _Penalty(keras.ops.sum)(hidden)
        hidden = _Penalty(keras.ops.mean)(hidden)
        hidden = _Penalty(keras.ops.sum, training_only=True)(hidden)
        model = keras.Model(inputs, {
            "a": keras.layers.Dense(2, name="a")(hidden),
            "b": keras.layers.Dense(1, name="b")(hidden)})
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss={"a": keras.losses.MeanSquaredError(reduction=reduction),
                  "b": keras.losses.MeanAbsoluteError()},
            loss_weights={"a": 0.7, "b": 0.5})
        return model

    x, y = _data(45)
    rng = np.random.default_rng(5)
    targets = {"a": y, "b": rng.normal(size=(45, 1)).astype("float32")}
    weights = rng.uniform(0.1, 2.0, size=(45,)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, targets, weights)).batch(14)
    single, expected, mirrored, logs = _both(make, ds)
    kind = "sum" if reduction == "sum" else "mean"
    assert mirrored._step_state.reductions.outputs == (kind, "mean")
    assert mirrored._step_state.reductions.extras == (
        "mean", "sum", "mean", "sum")
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    _assert_same_logs(expected, logs)


class _Flags(keras.Sequential):
    """Records each `training` flag `compute_loss` is traced with."""

    seen = None

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope
        if not in_symbolic_scope():
            type(self).seen.add(bool(training))
        return super().compute_loss(x, y, y_pred, sample_weight, training)


@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_compute_loss_sees_only_the_flags_keras_gives(method, monkeypatch):
    x, y = _data(45)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)

    def make():
        keras.utils.set_random_seed(0)
        model = _Flags([keras.Input((6,)), keras.layers.Dense(2)],
                       name="flags")
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    seen = []
    for wrap in (False, True):
        monkeypatch.setattr(_Flags, "seen", set())
        model = keras_mirror.MirroredModel(make()) if wrap else make()
        getattr(model, method)(ds, verbose=0)
        seen.append(_Flags.seen)
    assert seen[0] == {method == "fit"}
    assert seen[1] == seen[0]


def test_evaluate_then_fit_classifies_a_training_only_term_again():
    """`evaluate` classifies on an inference pass, where a term added in
    training only is absent: the first training call classifies again."""
    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
            _Penalty(keras.ops.sum, training_only=True),
            keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    x, y = _data(45)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(14)
    single = make()
    mirrored = keras_mirror.MirroredModel(make())
    np.testing.assert_allclose(mirrored.evaluate(ds, verbose=0),
                               single.evaluate(ds, verbose=0), rtol=1e-5)
    assert mirrored._step_state.reductions.extras == ()
    expected = single.fit(ds, epochs=2, verbose=0).history
    logs = mirrored.fit(ds, epochs=2, verbose=0).history
    assert mirrored._step_state.reductions.extras == ("sum",)
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    _assert_same_logs(expected, logs)
