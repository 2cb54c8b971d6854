"""`MirroredModel`: exact synchronous data-parallel training of a model."""

import functools

import keras

from keras_mirror import _compat
from keras_mirror import verify as verify_lib
from keras_mirror.callbacks import step_backup
from keras_mirror.distribute import _files
from keras_mirror.distribute import _homes
from keras_mirror.distribute import _multi_worker
from keras_mirror.distribute import _worker_input
from keras_mirror.distribute import devices as devices_lib
from keras_mirror.steps import _batchnorm
from keras_mirror.steps import _execution
from keras_mirror.steps import _stand_in
from keras_mirror.steps import _state
from keras_mirror.steps import dispatch
from keras_mirror.steps import own_step
from keras_mirror.wrapper import _arguments
from keras_mirror.wrapper import _compile
from keras_mirror.wrapper import _fit_input
from keras_mirror.wrapper import _model_methods
from keras_mirror.wrapper import _on_batch
from keras_mirror.wrapper import _rebuild
from keras_mirror.wrapper import _user_model
from keras_mirror.wrapper._replica_attributes import ReplicaAttributes


class MirroredModel(ReplicaAttributes, _user_model.UserModelState,
                    dispatch.StepDispatch, keras.Model):
    """Trains an existing Keras model data-parallel, exactly.

    Wraps any Keras 3 model (Sequential, Functional or subclassed, holding
    sub-models or custom layers; built or not; compiled or not) and trains
    that very object over `devices`: `mirrored.model is model`, with its
    own `train_step`, `test_step`, `predict_step`, `compute_loss`,
    `compute_metrics` and compile objects, unchanged. The user never
    enters `strategy.scope()`. Each step splits the global batch across the
    replicas by a documented plan (`split_plan`), weights each replica's loss
    by its share of the global batch, sums the gradients with one explicit
    all-reduce and applies them once: one step on `N` replicas equals one
    step on one device with the same global batch, to float tolerance, for
    uneven and empty shards too.

    Args:
        model: `keras.Model`: the model to train, in place. A
            zero-argument function returning one is also accepted.
        devices: list of str, or None. Device names (`"/gpu:0"`,
            `"/cpu:1"`, ...). None means every GPU, else every logical CPU.
        batch: str. `"global"` (default): each input batch is the global
            batch, split across replicas. `"per_replica"`: each input batch
            is one replica's batch; a step takes `N` consecutive ones (the
            TF 1.x Estimator semantics).
        on_nonfinite: str. What a NaN or Inf loss or gradient on any replica
            does: `"warn"` (default; warns with replica and step), `"skip_step"`
            (skips the update on all replicas and warns) or `"raise"` (skips
            it and raises `NonFiniteError`).
        gradient_dtype: str or None. `"bfloat16"` or `"float16"` sends
            gradients through the all-reduce in that dtype; default None
            (full precision).
        bytes_per_pack: int. Gradient bucket size for the all-reduce: the
            gradients, in variable order, go in buckets of at least this
            many bytes, one all-reduce per bucket (`allreduce.buckets`);
            0 sends them in one call and lets TensorFlow pack; default 0.
            A collective option.
        communication: str. All-reduce implementation, `"auto"`, `"ring"`
            or `"nccl"`; default `"auto"`. On one host, `"nccl"` asks for
            `NcclAllReduce` (GPUs only) and `"ring"` is refused (it names
            the collective ops' ring, which only clusters use). A
            collective option, as `bytes_per_pack`.
        timeout_seconds: float or None. Fail a collective that takes longer
            (a dead peer) instead of waiting forever; default None. Reaches
            the gradient all-reduce and, multi-worker, the strategy's
            `communication_options` (loss all-reduce and gathers).
        cluster: `keras_mirror.cluster.ClusterSpec`, a `TF_CONFIG`-shaped
            dict / JSON, or None (read `TF_CONFIG`). With two or more
            tasks, trains on `MultiWorkerMirroredStrategy`, `devices`
            being this worker's local devices; worker `w` hosts replicas
            `w * n_local ...` (`local_replica_ids`). Only the chief
            (`is_chief`) writes `save`/`save_weights`. With CPUs, call
            `keras_mirror.logical_cpus(n)` first thing: under a cluster it
            builds the strategy before TensorFlow initialises.
        execution: str. `"auto"` (default) or `"strategy"`: both run the
            one path, one replica step per device under
            `tf.distribute.MirroredStrategy` (`MultiWorkerMirroredStrategy`
            across hosts), a copy of the variables per device, gradients
            all-reduced; on GPUs and logical CPUs alike.
            `mirrored.summary()` says which strategy runs. The removed
            `"in_graph"` is refused with a message naming the replacement.
        worker_input: str. `"replicate"` (default): every worker reads
            the full, identical global batch and keeps its replicas' rows of
            the split plan over all replicas (logged at construction).
            `"shard"`: each worker reads only its share (rows of arrays, or
            virtual shards of a `tf.data` input), still exact.
        virtual_shards: int or None. Shards of a `tf.data` input with
            `worker_input="shard"`, fixed for the run: 1, 2, 3 workers or an
            elastic restart train on the same batches (docs/multi-worker.md).
            Default None: `KERAS_MIRROR_VIRTUAL_SHARDS`, else the workers.
        batchnorm: str. `"global"` (default): plain `BatchNormalization`
            normalises by the moments of the global batch's real rows, as
            on one device (an all-reduce in the forward pass).
            `"per_replica"`: each shard by its own moments (Keras's plain
            behaviour under `tf.distribute`; not exact).
        replica_stats: bool. Whether each training step computes the
            per-replica statistics (`replica_loss`, `replica_samples`,
            `replica_sample_weight`, `replica_grad_norm`,
            `replica_nonfinite`, `replica_step_time`) that fill the logs,
            `replica_history` and `ReplicaTensorBoard`. Default True. They
            read every gradient once more: on a 2 ms step of a small model
            that is 4-10% of the step (`benchmarks/README.md`), on an 11 ms
            step 0-3%. False drops them all, except
            `replica_nonfinite` when `on_nonfinite` is `"skip_step"` or
            `"raise"`, which need it; with the default `"warn"`,
            non-finite values then go unreported, as in plain Keras. A
            model with its own `train_step` then logs no `replica_<key>`
            vectors either.
        name: str or None. The wrapper's name.

    Example:

    ```python
    import keras
    import keras_mirror

    keras_mirror.logical_cpus(4)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    mirrored = keras_mirror.MirroredModel(model)
    mirrored.compile(optimizer="sgd", loss="mse")
    print(mirrored.split_plan(10))  # (3, 3, 2, 2)
    ```
    """

    _keras_mirror_wrapper = True  # `_rebuild.check_not_wrapped` reads it

    def __init__(self, model, devices=None, batch="global",
                 on_nonfinite="warn", gradient_dtype=None, bytes_per_pack=0,
                 communication="auto", timeout_seconds=None, cluster=None,
                 worker_input="replicate", execution="auto",
                 replica_stats=True, name=None, virtual_shards=None,
                 batchnorm="global"):
        _compat.check_keras_version()
        _compat.check_backend()
        _rebuild.check_no_outer_scope(model)
        _rebuild.check_model(model)
        comm = _arguments.check_construction(
            batch, on_nonfinite, replica_stats, communication, bytes_per_pack,
            timeout_seconds, gradient_dtype, execution, batchnorm)
        _rebuild.check_not_wrapped(model)
        resolved = devices_lib.resolve_devices(devices)
        spec = _multi_worker.cluster_spec(cluster)
        _multi_worker.check_worker_input(worker_input, spec)
        virtual_shards = _worker_input.check_virtual_shards(
            virtual_shards, worker_input, spec)
        if spec is not None:
            # Built before the model: TF must not initialise first.
            strategy = devices_lib.multi_worker_strategy(spec, resolved, comm)
        original = _rebuild.build_original(model)
        _rebuild.check_original(original, len(resolved), spec)
        reason = _execution.reason(execution, resolved, spec)
        if spec is None:
            strategy = devices_lib.mirrored_strategy(resolved, communication)
        _multi_worker.mark_ready()
        super().__init__(name=name or f"mirrored_{original.name}")
        self._strategy = strategy
        self._devices = tuple(resolved)
        self._execution_reason = reason
        self._multi_worker = spec is not None
        self._cluster = spec
        self._worker_input = worker_input
        self._virtual_shards = virtual_shards
        # The user's own model object trains: no copy, no config round trip.
        self._inner = original
        object.__setattr__(self, "_homes",
                           _homes.VariableHomes(original, strategy))
        object.__setattr__(self, "_step_state", _state.StepState())
        self._batch_mode = batch
        self._batchnorm = batchnorm
        _batchnorm.say_mode(original, batchnorm,
                            strategy.num_replicas_in_sync)
        self.on_nonfinite = on_nonfinite
        self._replica_stats = replica_stats
        self._gradient_dtype = gradient_dtype
        self._comm_options = comm
        self.replica_history = {}
        self._custom_step = own_step.setup(original)
        if self._custom_step:
            _stand_in.warn_unpadded_own_step(original, self._devices)
        if original.built:
            self.built = True
        if spec is not None:
            _multi_worker.log_layout(self)
        if getattr(original, "compiled", False):
            _compile.adopt(self)

    def call(self, inputs, training=None):
        return self._inner(inputs, training=training)

    # -- compile -----------------------------------------------------------

    def compile(self, *args, **kwargs):
        """Compiles the wrapped model, with its own `compile`'s arguments.

        The arguments go, unchanged, to the user's model's own `compile`
        (Keras's, or a GAN's `compile(d_optimizer=..., g_optimizer=...,
        loss_fn=...)`): its loss functions, metrics and optimizers are used
        as given, never rebuilt from a config, so unregistered custom
        objects work and an explicit `LossScaleOptimizer` is wrapped once.
        `jit_compile` is the model's: with it on, each replica's forward
        pass, loss and gradients run as one XLA function (the all-reduce
        and the optimizer update stay outside it; see `steps/_xla.py`).
        Compiling the model before wrapping it does the same.
        """
        _compile.compile(self, *args, **kwargs)

    # -- Keras training API ------------------------------------------------

    @_rebuild.outside_other_strategies
    @_model_methods.through_model
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_data=None, steps_per_epoch=None,
            **kwargs):
        """Trains as `keras.Model.fit`, with the input split per replica."""
        _compile.follow(self)
        _compile.require_compiled(self, "fit")
        early = step_backup.find(callbacks) if isinstance(
            callbacks, (list, tuple, keras.callbacks.CallbackList)) else None
        if early is not None:  # SIGTERM is caught while fit prepares too
            early.watch_signals()
        try:
            return self._fit_prepared(x, y, batch_size, epochs, verbose,
                                      callbacks, validation_data,
                                      steps_per_epoch, kwargs)
        finally:
            if early is not None:  # also when fit raised
                early.stop_watching()

    def _fit_prepared(self, x, y, batch_size, epochs, verbose, callbacks,
                      validation_data, steps_per_epoch, kwargs):
        prepared = _fit_input.prepare_fit(
            self, x, y, batch_size, epochs, verbose, callbacks,
            validation_data, steps_per_epoch, kwargs)
        backup = step_backup.find(prepared.callbacks)
        keras_fit = super().fit
        if self._worker_input == "shard":  # this worker's rows
            keras_fit = _worker_input.fit_reader(self, keras_fit)

        with self._homes.mirrored(), _user_model.saves_through(self):
            if backup is not None:
                return backup.resume_fit(
                    self, keras_fit, prepared.x, prepared.y,
                    prepared.batch_size, epochs, steps_per_epoch,
                    prepared.keras_kwargs, steps=prepared.steps)
            return keras_fit(
                prepared.x, prepared.y, batch_size=prepared.batch_size,
                epochs=epochs, steps_per_epoch=steps_per_epoch,
                **prepared.keras_kwargs)

    @_rebuild.outside_other_strategies
    @_model_methods.through_model
    def evaluate(self, x=None, y=None, batch_size=None, **kwargs):
        """Evaluates as `keras.Model.evaluate`, with exact global metrics."""
        _compile.follow(self)
        _compile.require_compiled(self, "evaluate")
        if not kwargs.get("_use_cached_eval_dataset"):
            x, batch_size = _fit_input.prepare_evaluate(self, x, y,
                                                        batch_size, kwargs)
        with self._homes.mirrored(), _user_model.saves_through(self):
            return super().evaluate(x, y, batch_size=batch_size, **kwargs)

    @_rebuild.outside_other_strategies
    @_model_methods.through_model
    def predict(self, x, batch_size=None, **kwargs):
        """Predicts as `keras.Model.predict`; rows keep the input order."""
        _compile.follow(self)
        x, batch_size = _fit_input.prepare_predict(self, x, batch_size,
                                                   kwargs)
        with self._homes.mirrored(), _user_model.saves_through(self):
            return super().predict(x, batch_size=batch_size, **kwargs)

    @_rebuild.outside_other_strategies
    @_model_methods.through_model
    def train_on_batch(self, x, y=None, sample_weight=None, **kwargs):
        """Runs one exact step on one global batch."""
        _compile.follow(self)
        _compile.require_compiled(self, "train_on_batch")
        _fit_input.prepare_batch(self, x, y, sample_weight)
        with self._homes.mirrored():
            return _on_batch.checked(self, functools.partial(
                super().train_on_batch, x, y, sample_weight=sample_weight,
                **kwargs))

    @_rebuild.outside_other_strategies
    @_model_methods.through_model
    def test_on_batch(self, x, y=None, sample_weight=None, **kwargs):
        """Evaluates one global batch exactly."""
        _compile.follow(self)
        _compile.require_compiled(self, "test_on_batch")
        _fit_input.prepare_batch(self, x, y, sample_weight)
        with self._homes.mirrored():
            return _on_batch.plain(self, "test", functools.partial(
                super().test_on_batch, x, y, sample_weight=sample_weight,
                **kwargs))[0]

    @_rebuild.outside_other_strategies
    @_model_methods.through_model
    def predict_on_batch(self, x):
        """Predicts one global batch; rows keep the input order."""
        _compile.follow(self)
        _fit_input.prepare_batch(self, x, predict=True)
        with self._homes.mirrored():
            return super().predict_on_batch(x)

    def verify(self, x, y=None, batch_size=None, steps=3, **kwargs):
        """`steps` steps here and on one device: a `VerifyReport`."""
        return verify_lib.verify(self, x, y, batch_size, steps, **kwargs)

    # -- the user's model and saving ----------------------------------------

    @property
    def model(self):
        """The user's own model object: the one that trains, live weights."""
        return self._inner

    def save(self, filepath, overwrite=True, **kwargs):
        """Saves the wrapped model as a `.keras` file, ready to train on.

        It is the user's own model, with its compile configuration and its
        optimizer's state, so `keras.saving.load_model` (without
        keras-mirror) returns a compiled model whose next `fit` step equals
        the wrapper's.
        """
        filepath = _files.check_suffix(
            filepath, ".keras", " (the only full-model format keras-mirror "
            "writes)")
        if not self.is_chief:
            return  # Only the chief writes; saving has no collective.
        _files.write_atomically(self._inner.save, filepath, overwrite,
                                **kwargs)

    def save_weights(self, filepath, overwrite=True, **kwargs):
        """Saves the weights (`.weights.h5`) of the wrapped model.

        As Keras's `save_weights`, the file holds the optimizer's state too
        (what Keras's `BackupAndRestore` relies on).
        """
        filepath = _files.check_suffix(filepath, ".weights.h5")
        if not self.is_chief:
            return  # Only the chief writes; saving has no collective.
        _files.write_atomically(self._inner.save_weights, filepath,
                                overwrite, **kwargs)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads `.weights.h5` weights into the wrapped model (all replicas):
        every shape is checked first, and nothing changes unless all fit.
        """
        filepath = _files.check_suffix(
            filepath, ".weights.h5", "; full models load with "
            "`keras.saving.load_model(..., safe_mode=True)`")
        _files.load_weights(self._inner, filepath, skip_mismatch, **kwargs)

    def export(self, filepath, format="tf_saved_model", **kwargs):
        """Exports the wrapped model for inference, as `keras.Model.export`.
        """
        return self._inner.export(filepath, format=format, **kwargs)

    def summary(self, *args, **kwargs):
        """Prints the replicas and execution path, then the model's summary.

        The header is a table in Keras's own `rich` style (long values wrap
        in their column); the wrapped model's `summary` follows, with the
        same arguments (`line_length`, `print_fn`, ...).
        """
        from keras_mirror.wrapper import _rendering

        _rendering.summary_header(self, kwargs)
        self._inner.summary(*args, **kwargs)

    def get_config(self):
        raise NotImplementedError(
            "A MirroredModel is not serialised itself: `save` writes the "
            "wrapped plain model, which loads without keras-mirror.")

