"""Exactness of MirroredModel against single-device training.

Also the tests of `keras_mirror/steps/_capacity.py`,
`keras_mirror/wrapper/_rebuild.py`, `keras_mirror/wrapper/_rendering.py`,
`keras_mirror/wrapper/_replica_attributes.py`.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from support.helpers import data
from support.helpers import max_diff
from support.helpers import mlp
from support.helpers import once
from support.helpers import summary_cells

import keras_mirror

# Each test runs on both execution paths (conftest.py).
pytestmark = pytest.mark.usefixtures("execution")

# First batch smaller than 4 replicas and uneven, then even, uneven, tiny.
BATCHES = (3, 8, 7, 5, 1)

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "sgd_global_clipnorm": lambda: keras.optimizers.SGD(
        0.1, global_clipnorm=0.05),
    "adamw_weight_decay": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1),
}


def _steps(model, batches, sample_weight):
    """`train_on_batch` over consecutive slices of `batches` rows: logs."""
    x, y, sw = data(sum(batches))
    start, logs = 0, []
    for rows in batches:
        sl = slice(start, start + rows)
        kwargs = {"sample_weight": sw[sl]} if sample_weight else {}
        logs.append(model.train_on_batch(x[sl], y[sl], return_dict=True,
                                         **kwargs))
        start += rows
    return logs


def _step_both(n, cpus, name, cache, batches=BATCHES, sample_weight=True):
    """(one device's weights, the wrapper, [(its logs, the wrapper's)])."""
    def reference():
        model = mlp()
        model.compile(optimizer=OPTIMIZERS[name](), loss="mse",
                      metrics=["mae"])
        logs = _steps(model, batches, sample_weight)
        return model.get_weights(), logs

    weights, ref_logs = once(cache, (name, batches, sample_weight), reference)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus[:n])
    mirrored.compile(optimizer=OPTIMIZERS[name](), loss="mse",
                     metrics=["mae"])
    logs = _steps(mirrored, batches, sample_weight)
    return weights, mirrored, list(zip(ref_logs, logs))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_adam_steps_equal_single_device_for_each_replica_count(
        n, cpus, one_device):
    weights, mirrored, losses = _step_both(n, cpus, "adam", one_device)
    assert max_diff(weights, mirrored.model.get_weights()) < 1e-5
    assert int(mirrored.optimizer.iterations.numpy()) == len(BATCHES)
    for ref, got in losses:
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6)
        assert got["mae"] == pytest.approx(ref["mae"], rel=1e-5, abs=1e-6)


# (Adam at N = 4 is the case above.)
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"adam"}))
def test_optimizer_options_see_the_global_gradient(name, cpus, one_device):
    weights, mirrored, _ = _step_both(4, cpus, name, one_device)
    assert max_diff(weights, mirrored.model.get_weights()) < 1e-5
    assert int(mirrored.optimizer.iterations.numpy()) == len(BATCHES)


def test_split_plan_matches_the_rows_replicas_receive(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(23)
    history = mirrored.fit(x, y, batch_size=10, epochs=1, shuffle=False,
                           verbose=0)
    steps = mirrored.replica_history["batch"]
    got = [tuple(int(v) for v in s["samples"]) for s in steps]
    assert got == [mirrored.split_plan(10), mirrored.split_plan(10),
                   mirrored.split_plan(3)]
    assert got[-1] == (1, 1, 1, 0)
    assert mirrored.replica_history["samples"][0] == [7, 7, 5, 4]
    assert set(history.history) == {"loss"}  # the vectors stay out


def test_split_plan_rules(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    assert mirrored.split_plan(10) == (3, 3, 2, 2)
    assert mirrored.split_plan(2) == (1, 1, 0, 0)
    assert mirrored.split_plan(0) == (0, 0, 0, 0)
    per_replica = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                             batch="per_replica")
    assert per_replica.split_plan(13, replica_batch_size=4) == (4, 4, 4, 1)
    assert per_replica.split_plan(5, replica_batch_size=4) == (4, 1, 0, 0)


def test_split_plan_takes_numpy_integers_as_fit_does(cpus):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    plan = mirrored.split_plan(np.int64(10))
    assert plan == (3, 3, 2, 2) and all(type(n) is int for n in plan)
    per_replica = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                             batch="per_replica")
    assert per_replica.split_plan(np.int32(13), replica_batch_size=np.int64(
        4)) == (4, 4, 4, 1)
    with pytest.raises(ValueError, match=r"Received: batch_size=np\.True_"):
        per_replica.split_plan(np.bool_(True))


def test_split_plan_refuses_a_replica_batch_size_in_global_mode(cpus):
    # It was ignored: the plan of another split was returned.
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    for value in (4, -5, "4"):
        with pytest.raises(ValueError, match=re.escape(
                "`replica_batch_size` applies to `batch='per_replica'` "
                "only: with batch='global' the global batch is split "
                f"evenly. Received: replica_batch_size={value!r}")):
            mirrored.split_plan(13, replica_batch_size=value)


@pytest.mark.parametrize("value,message", [
    (3, r"`replica_batch_size` is too small: 4 replica batches of 3 rows "
        r"hold 12, fewer than the 13 rows of the global batch\. Received: "
        r"replica_batch_size=3, batch_size=13"),
    (-1, r"`replica_batch_size` must be a positive integer or None\. "
         r"Received: replica_batch_size=-1"),
    (0, r"Received: replica_batch_size=0"),
    (4.0, r"Received: replica_batch_size=4\.0"),
    ("4", r"Received: replica_batch_size='4'"),
    (True, r"Received: replica_batch_size=True")])
def test_split_plan_refuses_a_bad_replica_batch_size(cpus, value, message):
    per_replica = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                             batch="per_replica")
    with pytest.raises(ValueError, match=message):
        per_replica.split_plan(13, replica_batch_size=value)


def test_fit_numpy_with_sample_and_class_weight_equals_single_device(cpus):
    x, _, sw = data(50)
    labels = (np.abs(x[:, 0] * 3).astype("int64") % 3)
    reference = mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), metrics=["accuracy"])
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
                     loss=keras.losses.SparseCategoricalCrossentropy(
                         from_logits=True), metrics=["accuracy"])
    kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0,
                  class_weight={0: 1.0, 1: 2.0, 2: 0.5})
    h_ref = reference.fit(x, labels, **kwargs)
    h_got = mirrored.fit(x, labels, **kwargs)
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5
    np.testing.assert_allclose(h_got.history["loss"], h_ref.history["loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(h_got.history["accuracy"],
                               h_ref.history["accuracy"], rtol=1e-6)
    del sw


def test_tf_data_and_pydataset_inputs(cpus):
    x, y, sw = data(30)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            sl = slice(i * 8, min(30, i * 8 + 8))
            return x[sl], y[sl], sw[sl]

    ds = tf.data.Dataset.from_tensor_slices((x, y, sw)).batch(8)
    results = []
    for source in (ds, Batches()):
        reference = mlp()
        reference.compile(optimizer="adam", loss="mse")
        mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
        mirrored.compile(optimizer="adam", loss="mse")
        reference.fit(source, epochs=2, shuffle=False, verbose=0)
        mirrored.fit(source, epochs=2, shuffle=False, verbose=0)
        results.append(max_diff(reference.get_weights(),
                                mirrored.model.get_weights()))
    assert max(results) < 1e-5


def test_per_replica_batches_equal_single_device_on_joined_batches(cpus):
    x, y, _ = data(30)
    per_replica_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    # 30 rows -> batches 4*7 + 2: 8 batches, two steps (16 rows, 14 rows).
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          batch="per_replica")
    mirrored.compile(optimizer="adam", loss="mse")
    mirrored.fit(per_replica_ds, epochs=1, verbose=0)
    reference = mlp()
    reference.compile(optimizer="adam", loss="mse")
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5
    steps = [tuple(int(v) for v in s["samples"])
             for s in mirrored.replica_history["batch"]]
    assert steps == [(4, 4, 4, 4), (4, 4, 4, 2)]


def test_per_replica_numpy_uses_batch_size_per_replica(cpus):
    x, y, _ = data(37)
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus,
                                          batch="per_replica")
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = mlp()
    reference.compile(optimizer="sgd", loss="mse")
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    steps = [tuple(int(v) for v in s["samples"])
             for s in mirrored.replica_history["batch"]]
    assert steps == [(4, 4, 4, 4), (4, 4, 4, 4), (4, 1, 0, 0)]
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5


def test_evaluate_and_predict_are_exact_and_ordered(cpus):
    x, y, sw = data(29)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    ref = model.evaluate(x, y, sample_weight=sw, batch_size=9, verbose=0,
                         return_dict=True)
    got = mirrored.evaluate(x, y, sample_weight=sw, batch_size=9, verbose=0,
                            return_dict=True)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["mae"] == pytest.approx(ref["mae"], rel=1e-6)
    np.testing.assert_allclose(mirrored.predict(x, batch_size=9, verbose=0),
                               model.predict(x, batch_size=9, verbose=0),
                               atol=1e-6)
    np.testing.assert_allclose(mirrored.predict_on_batch(x[:3]),
                               model.predict_on_batch(x[:3]), atol=1e-6)


def test_compiled_model_carries_its_configuration(cpus):
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(0.003, beta_1=0.8),
                  loss="mae", metrics=["mse"])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    assert type(mirrored.optimizer) is keras.optimizers.Adam
    assert mirrored.optimizer.get_config()["beta_1"] == pytest.approx(0.8)
    assert float(mirrored.optimizer.learning_rate.numpy()) == \
        pytest.approx(0.003)
    x, y, _ = data(12)
    logs = mirrored.train_on_batch(x, y, return_dict=True)
    assert set(logs) >= {"loss", "mse"}


def _functional():
    keras.utils.set_random_seed(3)
    a = keras.Input((4,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="relu")(
        keras.layers.Concatenate()([a, b]))
    out1 = keras.layers.Dense(1, name="reg")(h)
    out2 = keras.layers.Dense(3, name="cls")(h)
    return keras.Model({"a": a, "b": b}, {"reg": out1, "cls": out2})


def test_multi_input_multi_output_functional_with_loss_weights(cpus):
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(21, 4)).astype("float32"),
         "b": rng.normal(size=(21, 2)).astype("float32")}
    y = {"reg": rng.normal(size=(21, 1)).astype("float32"),
         "cls": rng.integers(0, 3, size=(21,))}
    compile_args = dict(
        loss={"reg": "mse", "cls": keras.losses.SparseCategoricalCrossentropy(
            from_logits=True)},
        loss_weights={"reg": 0.3, "cls": 1.0},
        metrics={"cls": ["accuracy"]})
    reference = _functional()
    reference.compile(optimizer="adam", **compile_args)
    mirrored = keras_mirror.MirroredModel(_functional(), devices=cpus[:3])
    mirrored.compile(optimizer="adam", **compile_args)
    h_ref = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                          verbose=0)
    h_got = mirrored.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                         verbose=0)
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5
    np.testing.assert_allclose(h_got.history["loss"], h_ref.history["loss"],
                               rtol=1e-5)


@keras.saving.register_keras_serializable(package="tests")
class Subclassed(keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class NoConfig(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return self.dense(x)


def test_subclassed_built_model_and_factory(cpus):
    x, y, _ = data(18)
    keras.utils.set_random_seed(5)
    model = Subclassed()
    model(x[:1])
    reference = Subclassed()
    reference(x[:1])
    reference.set_weights(model.get_weights())
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    for m in (reference, mirrored):
        m.compile(optimizer="sgd", loss="mse")
        m.fit(x, y, batch_size=7, epochs=1, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5
    factory = keras_mirror.MirroredModel(lambda: NoConfig(3), devices=cpus)
    factory.compile(optimizer="sgd", loss="mse")
    factory.fit(x, y, batch_size=7, verbose=0)
    assert factory.model.built


# A model without `get_config` trained in place: the guide-model matrix,
# e2e/test_existing_code.py (`no_config`, both paths, an empty shard too).


def test_unbuilt_sequential_builds_on_first_uneven_batch(cpus):
    x, y, _ = data(7)
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(3)])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus)
    mirrored.compile(optimizer="sgd", loss="mse")
    mirrored.fit(x, y, batch_size=3, epochs=1, verbose=0)
    assert model.built
    np.testing.assert_allclose(mirrored.model.predict(x, verbose=0),
                               mirrored.predict(x, verbose=0), atol=1e-6)


def test_num_replicas_devices_and_summary(cpus, capsys, execution):
    mirrored = keras_mirror.MirroredModel(mlp(), devices=["/cpu:1", "/cpu:3"])
    assert mirrored.num_replicas == 2
    assert mirrored.devices == (cpus[1], cpus[3])
    assert mirrored.execution == execution
    header, cells = summary_cells(mirrored)
    assert header.splitlines()[0] == f'MirroredModel: "{mirrored.name}"'
    assert cells["Replicas"] == "2: /device:CPU:1, /device:CPU:3"
    assert cells["Batch"] == "'global'"
    assert cells["Execution path"] == mirrored.execution_summary
    assert mirrored.execution_summary.startswith(f"{execution} (")
    assert mirrored.execution_summary.endswith(
        f"because execution='{execution}' was asked for.")
    # Rendered by rich like Keras's own summary, and wrapped to its width.
    assert max(len(line) for line in header.splitlines()) <= 88
    mirrored.summary()
    out = capsys.readouterr().out
    assert out.startswith(header)
    assert 'Model: "sequential' in out


def test_steps_per_execution_is_exact(cpus):
    x, y, _ = data(40)
    reference = mlp()
    reference.compile(optimizer="adam", loss="mse")
    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus)
    mirrored.compile(optimizer="adam", loss="mse", steps_per_execution=2)
    reference.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    mirrored.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    assert max_diff(reference.get_weights(), mirrored.model.get_weights()) \
        < 1e-5


def test_train_on_batch_keeps_each_replica_vector_aside(cpus):
    # The step returns its per-replica statistics packed in one tensor;
    # `train_on_batch` returns plain Keras's values and the vectors wait in
    # `last_replica_logs`, in replica order.
    from keras_mirror.steps import _replica_stats

    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus[:3])
    mirrored.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x, y, sw = data(7)
    logs = mirrored.train_on_batch(x, y, sample_weight=sw, return_dict=True)
    assert set(logs) == {"loss", "mae"}
    vectors = mirrored.last_replica_logs
    assert set(vectors) == {k[len("replica_"):]
                            for k in _replica_stats.STAT_KEYS}
    assert vectors["samples"].tolist() == list(mirrored.split_plan(7))
    assert vectors["sample_weight"] == pytest.approx(
        [sw[:3].sum(), sw[3:5].sum(), sw[5:].sum()], rel=1e-6)
    assert all(v.shape == (3,) for v in vectors.values())
    assert (vectors["grad_norm"] > 0).all()
    assert vectors["nonfinite"].tolist() == [0, 0, 0]
    loss, mae = mirrored.train_on_batch(x, y, sample_weight=sw)
    assert isinstance(loss, float) and isinstance(mae, float)


def test_the_step_packs_its_statistics_into_one_output(cpus):
    from keras_mirror.steps import _replica_stats

    mirrored = keras_mirror.MirroredModel(mlp(), devices=cpus[:2])
    mirrored.compile(optimizer="sgd", loss="mse")
    x, y, _ = data(5)
    mirrored.train_on_batch(x, y)
    step = tf.function(lambda d: mirrored.distribute_strategy.run(
        mirrored.train_step, args=(d,)))
    with mirrored._homes.mirrored():  # the variables as in `fit`
        logs = step((tf.constant(x), tf.constant(y)))
    assert set(logs) == {"loss", _replica_stats.PACKED}
    packed = mirrored.distribute_strategy.experimental_local_results(
        logs[_replica_stats.PACKED])[0]
    assert packed.shape == (2, len(_replica_stats.STAT_KEYS))
    samples = _replica_stats.STAT_KEYS.index("replica_samples")
    assert packed.numpy()[:, samples].tolist() == [3, 2]


def _masked_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(10, 4, mask_zero=True),
        keras.layers.Dense(3),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


def _masked_data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 10, size=(rows, 6)).astype("int32")
    # Padding grows down the batch, so replicas see very different counts
    # of unmasked entries (all of a row padded, in some).
    for i in range(rows):
        x[i, 6 - (i % 7):] = 0
    y = rng.integers(0, 3, size=(rows, 6)).astype("int32")
    sw = rng.uniform(0.5, 2.0, size=(rows, 6)).astype("float32")
    return x, y, sw


def test_masked_loss_and_metrics_equal_single_device(cpus):
    # Keras divides a masked output's loss by its unmasked entries and skips
    # masked entries in metrics: shards are weighted by their unmasked
    # entries, and the global predictions carry the shards' masks.
    reference = _masked_model()
    mirrored = keras_mirror.MirroredModel(_masked_model(), devices=cpus[:3])
    x, y, sw = _masked_data(19)
    for rows in (8, 7, 4):  # uneven shards, one of them with no entries
        sl = slice(0, rows)
        ref = reference.train_on_batch(x[sl], y[sl], sample_weight=sw[sl],
                                       return_dict=True)
        got = mirrored.train_on_batch(x[sl], y[sl], sample_weight=sw[sl],
                                      return_dict=True)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert got["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-6)
        x, y, sw = np.roll(x, 5, 0), np.roll(y, 5, 0), np.roll(sw, 5, 0)
    assert max_diff(reference.get_weights(),
                    mirrored.model.get_weights()) < 1e-5
    ref = reference.evaluate(x, y, sample_weight=sw, batch_size=7,
                             verbose=0, return_dict=True)
    got = mirrored.evaluate(x, y, sample_weight=sw, batch_size=7,
                            verbose=0, return_dict=True)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-6)


def test_masked_output_of_a_multi_output_model_warns(cpus):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, mask_zero=True)(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3)(hidden),
                                 keras.layers.Dense(2)(hidden)])
    model.compile(optimizer="sgd", loss=["mse", "mse"])
    mirrored = keras_mirror.MirroredModel(model, devices=cpus[:2])
    x, _, _ = _masked_data(4)
    ys = [np.zeros((4, 6, 3), "float32"), np.zeros((4, 6, 2), "float32")]
    with pytest.warns(UserWarning, match="several outputs and a mask"):
        mirrored.train_on_batch(x, ys)


@pytest.mark.parametrize("gradient_dtype", [None, "bfloat16"])
def test_sparse_embedding_gradients_with_adam_equal_single_device(
        cpus, gradient_dtype):
    # Embedding gradients are sparse, with a row per token: Keras's Adam
    # squares each row's values before duplicate rows add up. Summing the
    # replicas' gradients densely would square the sums; they are gathered.
    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(4, 3),  # 4 ids: many duplicates
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        return model

    reference = build()
    mirrored = keras_mirror.MirroredModel(build(), devices=cpus[:3],
                                          gradient_dtype=gradient_dtype)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(20, 5)).astype("int32")
    y = rng.normal(size=(20, 2)).astype("float32")
    for rows in (7, 8, 5):
        reference.train_on_batch(x[:rows], y[:rows])
        mirrored.train_on_batch(x[:rows], y[:rows])
        x, y = np.roll(x, 3, 0), np.roll(y, 3, 0)
    tolerance = 1e-5 if gradient_dtype is None else 2e-2
    assert max_diff(reference.get_weights(),
                    mirrored.model.get_weights()) < tolerance
