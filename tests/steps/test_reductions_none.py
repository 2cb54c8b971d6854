"""`reduction="none"` and `"mean_with_sample_weight"` train as Keras does.

Issue 38. Keras's step differentiates the sum of an unreduced loss's
vector and logs its mean; a `"mean_with_sample_weight"` loss is
`sum(w * l) / sum(w)` over the global batch. Each test trains one device
and `MirroredModel` on 1, 2 or 4 logical CPUs for 2 epochs over batches of
10, 10 and 3 rows (on 4 replicas the last batch leaves one shard empty)
and asserts equal weights (1e-5) and equal logged losses.

Also the tests of `check_reductions` in `keras_mirror/wrapper/_compile.py`.
"""

import keras
import numpy as np
import pytest
from support.helpers import max_diff

import keras_mirror

ROWS, BATCH = 23, 10  # batches of 10, 10 and 3 rows


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 2)).astype("float32")
    sw = rng.uniform(0.1, 3.0, size=(ROWS,)).astype("float32")
    return x, y, sw


def _one_output(reduction):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
        keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.02),
                  loss=keras.losses.MeanSquaredError(reduction=reduction))
    return model


def _outputs(reductions):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    names = "abcd"[:len(reductions)]
    model = keras.Model(inputs, {
        n: keras.layers.Dense(2, name=n)(hidden) for n in names})
    model.compile(
        optimizer=keras.optimizers.SGD(0.02),
        loss={n: keras.losses.MeanAbsoluteError(reduction=r)
              for n, r in zip(names, reductions)},
        loss_weights=dict(zip(names, (1.0, 0.5, 2.0, 0.25))))
    return model


def _fit(model, x, y, sw, devices=None):
    if devices is not None:
        model = keras_mirror.MirroredModel(model, devices=devices)
    history = model.fit(x, y, sample_weight=sw, batch_size=BATCH, epochs=2,
                        shuffle=False, verbose=0)
    return model, history.history


def _assert_as_one_device(make, cpus, replicas, weighted=True, targets=None):
    x, y, sw = _data()
    y = y if targets is None else targets(y)
    sw = sw if weighted else None
    single, expected = _fit(make(), x, y, sw)
    mirrored, logs = _fit(make(), x, y, sw, cpus[:replicas])
    assert max_diff(single.get_weights(), mirrored.get_weights()) < 1e-5
    np.testing.assert_allclose(logs["loss"], expected["loss"], rtol=1e-5)
    return mirrored, expected, logs


MWS = "mean_with_sample_weight"


@pytest.mark.parametrize("reduction,replicas", [
    ("none", 1), ("none", 4), (MWS, 2), (MWS, 4)])
def test_one_output_trains_as_one_device(cpus, reduction, replicas):
    mirrored, _, _ = _assert_as_one_device(
        lambda: _one_output(reduction), cpus, replicas)
    kind = {"none": "sum", MWS: "weighted_mean"}
    assert mirrored._step_state.reductions.outputs == (kind[reduction],)


@pytest.mark.parametrize("reduction", [None, MWS])
def test_one_output_without_sample_weight(cpus, reduction):
    _assert_as_one_device(lambda: _one_output(reduction), cpus, 4,
                          weighted=False)


def _targets(y):
    return {"a": y, "b": y[:, ::-1] * 2.0, "c": y - 1.0, "d": -y}


@pytest.mark.parametrize("reductions,replicas", [
    # Beside a "none" output Keras adds each scalar loss to every element
    # of its vector: a mean then counts as a sum, a sum `B` times on one
    # device and `b_r` times on replica `r`.
    (("none", MWS, "sum", "sum_over_batch_size"), 4),
    ((MWS, "sum", "sum_over_batch_size", "sum_over_batch_size"), 2),
])
def test_outputs_mixing_reductions_train_as_one_device(
        cpus, reductions, replicas):
    mirrored, expected, logs = _assert_as_one_device(
        lambda: _outputs(reductions), cpus, replicas, targets=_targets)
    for name, reduction in zip("abcd", reductions):
        if reduction != MWS:  # see docs/exactness.md
            np.testing.assert_allclose(
                logs[f"{name}_loss"], expected[f"{name}_loss"], rtol=1e-5,
                err_msg=name)


class _MedianLoss(keras.losses.Loss):
    """A `Loss` reducing its own way: a reduction Keras does not define."""

    def __init__(self):
        super().__init__(name="median_loss")
        self.reduction = "median"

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.median(keras.ops.abs(y_true - y_pred))


def test_a_reduction_keras_does_not_define_is_refused(cpus):
    mirrored = keras_mirror.MirroredModel(_one_output("sum"), devices=cpus)
    loss = _MedianLoss()
    with pytest.raises(ValueError) as raised:
        mirrored.compile(optimizer="sgd", loss=loss)
    assert str(raised.value) == (
        "`loss` must have a reduction Keras defines, one of "
        "('sum_over_batch_size', 'mean', 'sum', 'mean_with_sample_weight', "
        "'none', None): keras-mirror weights each replica's loss by its "
        "reduction, and another reduction's share of the global batch is "
        f"unknown. Received: loss={loss!r} with reduction='median'")


class _OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        return 2.0 * super().compute_loss(x, y, y_pred, sample_weight,
                                          training)


def test_a_weighted_mean_under_a_compute_loss_override_is_refused(cpus):
    inputs = keras.Input((4,))
    model = _OwnLoss(inputs, keras.layers.Dense(2)(inputs))
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    with pytest.raises(ValueError) as raised:
        mirrored.compile(optimizer="sgd", loss=loss)
    assert str(raised.value) == (
        "`loss` with reduction='mean_with_sample_weight' cannot be weighted "
        "under a `compute_loss` override: each replica's share is its part "
        "of the global sum of sample weights, and keras-mirror sees the "
        "override's combination of the outputs only as a whole. Use "
        "reduction='sum_over_batch_size' or 'sum', or Keras's own "
        f"`compute_loss`. Received: loss={loss!r} with "
        "reduction='mean_with_sample_weight' and "
        "compute_loss=_OwnLoss.compute_loss")
