"""Existing Keras code, unchanged: wrapped as an instance, trained exactly.

Each model of `guide_models.py` (written as the Keras guides write them) is
trained twice from the same seed: by its own `fit` on one device, and
wrapped as the instance it is by `MirroredModel` over 4 logical CPUs, with
batches of 14 rows (split 4/4/3/3) and a last batch of 3 rows (one replica
empty). The wrapped object must be the user's, hold the trained weights and
equal one device's within 1e-5; so must the logged values.
"""

import keras
import numpy as np
import pytest
from support import guide_models
from support.helpers import once

import keras_mirror

TOL = 1e-5
EPOCHS = 2


def _fit(builder, wrap, execution="auto", **fit_kwargs):
    keras.utils.set_random_seed(42)
    model, compile_kwargs, (x, y) = builder()
    model.compile(**compile_kwargs)
    target = model
    if wrap:
        target = keras_mirror.MirroredModel(model, execution=execution)
        assert target.model is model
    history = target.fit(x, y, batch_size=guide_models.BATCH, epochs=EPOCHS,
                         shuffle=False, verbose=0, **fit_kwargs)
    return model, target, history.history, (x, y)


def _single_device(cache, builder, case="fit", **fit_kwargs):
    """(weights, History logs) of one device's fit of a guide model; kept
    under (builder, `case`): one `case` is one set of `fit_kwargs`."""
    def fit():
        single, _, logs, _ = _fit(builder, wrap=False, **fit_kwargs)
        return single.get_weights(), logs

    return once(cache, (builder.__name__, case), fit)


def _weights(model_or_weights):
    if isinstance(model_or_weights, list):
        return model_or_weights
    return model_or_weights.get_weights()


def _assert_same(single, mirrored):
    a, b = _weights(single), _weights(mirrored)
    assert len(a) == len(b)
    diff = max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))
    assert diff < TOL, diff


def _assert_logs(single, mirrored, keys=None):
    keys = keys or [k for k in single if not k.startswith("replica_")]
    for key in keys:
        np.testing.assert_allclose(mirrored[key], single[key], rtol=2e-5,
                                   atol=2e-6, err_msg=key)


@pytest.mark.parametrize("name", sorted(guide_models.BUILT_IN))
@pytest.mark.parametrize("execution", ["strategy"])
def test_guide_models_train_as_on_one_device(name, execution, cpus,
                                             one_device):
    builder = guide_models.BUILT_IN[name]
    single, logs1 = _single_device(one_device, builder)
    model, mirrored, logs2, _ = _fit(builder, wrap=True, execution=execution)
    assert mirrored.model is model
    _assert_same(single, model)
    _assert_logs(logs1, logs2)
    # The History keys are plain Keras's, plus the opt-in vectors only.
    assert set(k for k in logs2 if not k.startswith("replica_")) == set(logs1)


@pytest.mark.parametrize("name", sorted(guide_models.OWN_STEP))
def test_models_with_their_own_train_step(name, cpus):
    builder = guide_models.OWN_STEP[name]
    single, _, logs1, _ = _fit(builder, wrap=False)
    model, mirrored, logs2, _ = _fit(builder, wrap=True)
    assert mirrored.execution == "strategy"
    _assert_same(single, model)
    _assert_logs(logs1, logs2)


@pytest.mark.parametrize("execution", ["strategy"])
def test_evaluate_with_own_test_step_and_compute_loss(execution, cpus,
                                                      one_device):
    def evaluate(builder):
        single, _, _, (x, y) = _fit(builder, wrap=False)
        return single.evaluate(x, y, batch_size=guide_models.BATCH,
                               verbose=0, return_dict=True)

    for builder in (guide_models.test_step_override,
                    guide_models.compute_loss_override):
        one = once(one_device, ("evaluate", builder.__name__),
                   lambda: evaluate(builder))
        model, mirrored, _, (x, y) = _fit(builder, wrap=True,
                                          execution=execution)
        many = mirrored.evaluate(x, y, batch_size=guide_models.BATCH,
                                 verbose=0, return_dict=True)
        for key in one:
            np.testing.assert_allclose(many[key], one[key], rtol=2e-5,
                                       err_msg=key)


@pytest.mark.parametrize("execution", ["strategy"])
def test_sample_weights_in_the_guide_step_and_builtin(execution, cpus,
                                                      one_device):
    rng = np.random.default_rng(0)
    sw = rng.uniform(0.1, 2.0, size=(guide_models.ROWS,)).astype("float32")
    builders = [guide_models.custom_objects, guide_models.multi_io]
    if execution == "strategy":
        builders.append(guide_models.guide_train_step)
    for builder in builders:
        single, logs1 = _single_device(one_device, builder, "weighted",
                                       sample_weight=sw)
        model, _, logs2, _ = _fit(builder, wrap=True, execution=execution,
                                  sample_weight=sw)
        _assert_same(single, model)
        _assert_logs(logs1, logs2)


def test_the_users_model_keeps_working_on_one_device(cpus):
    model, compile_kwargs, (x, y) = guide_models.no_config()
    model.compile(**compile_kwargs)
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    mirrored.fit(x, y, batch_size=14, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 4
    assert int(mirrored.optimizer.iterations) == 4
    before = model.get_weights()
    # The user's own fit after the wrapper's: on one device, from the
    # trained weights and optimizer state.
    model.fit(x, y, batch_size=14, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 8
    assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(
        before, model.get_weights()))
    # And the wrapper again, from those.
    mirrored.fit(x, y, batch_size=14, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 12


def test_explicit_loss_scale_optimizer_is_not_wrapped_twice(cpus):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model, _, (x, y) = guide_models.no_config()
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        mirrored = keras_mirror.MirroredModel(model)
        mirrored.compile(optimizer=opt, loss="mse")
        assert model.optimizer is opt
        assert not isinstance(opt.inner_optimizer,
                              keras.optimizers.LossScaleOptimizer)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("execution", ["strategy"])
def test_keras_backup_and_restore_resumes_exactly(execution, cpus, tmp_path,
                                                 one_device):
    builder = guide_models.no_config

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    uninterrupted, _ = _single_device(one_device, builder)
    keras.utils.set_random_seed(42)
    model, compile_kwargs, (x, y) = builder()
    model.compile(**compile_kwargs)
    mirrored = keras_mirror.MirroredModel(model, execution=execution)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    with pytest.raises(RuntimeError, match="interrupted"):
        mirrored.fit(x, y, batch_size=14, epochs=3, shuffle=False,
                     verbose=0, callbacks=[backup, Stop()])
    keras.utils.set_random_seed(42)
    model, compile_kwargs, _ = builder()
    model.compile(**compile_kwargs)
    mirrored = keras_mirror.MirroredModel(model, execution=execution)
    mirrored.fit(x, y, batch_size=14, epochs=2, shuffle=False, verbose=0,
                 callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path))])
    assert int(model.optimizer.iterations) == 8
    _assert_same(uninterrupted, model)


def test_export_and_iterations_after_training(cpus, tmp_path):
    model, compile_kwargs, (x, y) = guide_models.no_config()
    model.compile(**compile_kwargs)
    mirrored = keras_mirror.MirroredModel(model, execution="strategy")
    mirrored.fit(x, y, batch_size=14, epochs=1, verbose=0)
    assert int(mirrored.optimizer.iterations) == 4
    mirrored.export(str(tmp_path / "a"), verbose=False)
    mirrored.model.export(str(tmp_path / "b"), verbose=False)
    import tensorflow as tf

    served = tf.saved_model.load(str(tmp_path / "a"))
    np.testing.assert_allclose(served.serve(x[:5]).numpy(),
                               model.predict(x[:5], verbose=0), rtol=1e-6)


def test_double_wrap_is_refused(cpus):
    model, _, _ = guide_models.no_config()
    mirrored = keras_mirror.MirroredModel(model)
    with pytest.raises(ValueError, match="already a `MirroredModel`"):
        keras_mirror.MirroredModel(mirrored)


@pytest.mark.parametrize("execution", ["strategy"])
def test_validation_logs_per_output_equal_one_device(execution, cpus,
                                                     one_device):
    builder = guide_models.multi_io
    _, _, (x, y) = builder()
    val = ([t[:17] for t in x], [t[:17] for t in y])
    single, logs1 = _single_device(one_device, builder, "validation",
                                   validation_data=val)
    model, _, logs2, _ = _fit(builder, wrap=True, execution=execution,
                              validation_data=val)
    assert any(k.startswith("val_out_b") for k in logs1)
    _assert_same(single, model)
    _assert_logs(logs1, logs2)


@pytest.mark.parametrize("execution", ["strategy"])
def test_a_model_trained_before_wrapping_keeps_its_optimizer_state(
        execution, cpus, one_device):
    # Adam's moments and step count, and the Dropout and GaussianNoise
    # seed state, from a plain fit before wrapping. (The guide matrix
    # trains the transformer; here its cost bought nothing more.)
    def run(wrap):
        keras.utils.set_random_seed(42)
        model, compile_kwargs, (x, y) = guide_models.noisy()
        model.compile(**compile_kwargs)
        model.fit(x, y, batch_size=14, epochs=1, shuffle=False, verbose=0)
        target = keras_mirror.MirroredModel(model, execution=execution) \
            if wrap else model
        target.fit(x, y, batch_size=14, epochs=1, shuffle=False, verbose=0)
        return model

    single = once(one_device, "pretrained",
                  lambda: run(False).get_weights())
    model = run(True)
    assert int(model.optimizer.iterations) == 8
    _assert_same(single, model)


@pytest.mark.parametrize("synchronized", [True, False])
def test_own_step_with_global_batchnorm_wraps_without_warning(cpus,
                                                              synchronized):
    """BatchNorm in an own step is exact (`wgan_gp_bn` above, and
    tests/steps/test_batchnorm.py): wrapping it warns of nothing."""
    import warnings

    model, _, _ = guide_models.gan()
    model.discriminator = keras.Sequential([
        keras.Input((6,)), keras.layers.BatchNormalization(
            synchronized=synchronized, name="critic_bn"),
        keras.layers.Dense(1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras_mirror.MirroredModel(model)
    assert [str(w.message) for w in caught
            if "BatchNormalization" in str(w.message)] == []


# On the path a GPU runs: what this adds to the guide matrix (where the
# transformer trains on both paths) is a real library's model, built from
# its config, with dict inputs, a padding mask and weighted metrics.
@pytest.mark.parametrize("execution", ["strategy"])
def test_keras_hub_causal_lm_built_from_a_config(execution, cpus,
                                                one_device):
    keras_hub = pytest.importorskip("keras_hub")

    def build():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=8, dropout=0.1)
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone,
                                           preprocessor=None)
        lm.compile(optimizer=keras.optimizers.Adam(1e-2),
                   loss=keras.losses.SparseCategoricalCrossentropy(
                       from_logits=True),
                   weighted_metrics=["accuracy"])
        return lm

    tokens = np.random.default_rng(0).integers(1, 50, size=(45, 8))
    x = {"token_ids": tokens[:, :-1].astype("int32"),
         "padding_mask": np.ones((45, 7), "bool")}
    y = tokens[:, 1:].astype("int32")
    def fit():
        single = build()
        logs = single.fit(x, y, batch_size=14, epochs=2, shuffle=False,
                          verbose=0).history
        return single.get_weights(), logs

    single, logs1 = once(one_device, "gpt2", fit)
    lm = build()
    mirrored = keras_mirror.MirroredModel(lm, execution=execution)
    logs2 = mirrored.fit(x, y, batch_size=14, epochs=2, shuffle=False,
                         verbose=0).history
    assert mirrored.model is lm
    _assert_same(single, lm)
    _assert_logs(logs1, logs2)
