"""Every private Keras and TensorFlow attribute keras-mirror relies on.

Keras 3 has no public hook for two things that exact data-parallel training
needs, and TensorFlow's `MultiWorkerMirroredStrategy` none for choosing a
worker's devices. Each access below says why; `tests/test_compat.py` has one
test per attribute, so that a Keras or TensorFlow release that renames or
removes one fails loudly there instead of silently counting gradients `N`
times or training on the wrong devices.

Supported range: Keras 3.14 and 3.15 (3.14 brought the 2025-2026 fixes to
safe-mode loading that keras-mirror's saving relies on).
"""

import contextlib

import keras

SUPPORTED_KERAS = ((3, 14), (3, 16))  # [low, high)

# The TF backend's optimizer sums gradients across replicas inside `apply`
# (`TFOptimizer._all_reduce_sum_gradients`). keras-mirror all-reduces them
# itself first (so that clipping, weight decay and loss scaling see the global
# gradient, as on one device) and must switch this second reduction off, or
# gradients would count `N` times.
_ALLREDUCE_HOOK = "_all_reduce_sum_gradients"

# `fit` starts at `Trainer._initial_epoch` when set; Keras's `BackupAndRestore`
# sets it on the model it resumes. Callbacks get the user's model, so the
# wrapper's attribute is the user model's (`_user_model.UserModelState`).
INITIAL_EPOCH = "_initial_epoch"

# The loss tracker that `fit` reports as `loss`; Keras exposes it only through
# `model.metrics`, by name, so we look it up there.
_LOSS_TRACKER = "_loss_tracker"


# Keras builds the compiled loss and metrics lazily, on their first call. In a
# replica step that would create their variables inside `strategy.run`;
# `Trainer._symbolic_build` (what stock `fit` runs under a strategy) builds
# them from a batch's shapes without running a step.
_SYMBOLIC_BUILD = "_symbolic_build"


def keras_version():
    """The installed Keras version as a tuple of ints (major, minor)."""
    return tuple(int(p) for p in keras.__version__.split(".")[:2])


def check_keras_version():
    """Raises ImportError on a Keras release outside the supported range."""
    low, high = SUPPORTED_KERAS
    if not (low <= keras_version() < high):
        raise ImportError(
            "keras-mirror supports Keras >= "
            f"{low[0]}.{low[1]} and < {high[0]}.{high[1]}. "
            f"Received: keras.__version__={keras.__version__!r}"
        )


def check_backend():
    """Raises ValueError unless Keras runs on the TensorFlow backend.

    keras-mirror trains on `tf.distribute`; with another backend
    (`KERAS_BACKEND=jax`) `MirroredModel` would build, then fail later.
    """
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            "keras-mirror needs Keras's TensorFlow backend (it trains on "
            "`tf.distribute`). Set `KERAS_BACKEND=tensorflow` (or "
            '`"backend": "tensorflow"` in ~/.keras/keras.json) before '
            f"importing Keras. Received: keras.backend.backend()={backend!r}"
        )


def _missing(what, purpose):
    """The error for a private Keras name that a release no longer has."""
    return RuntimeError(
        f"This Keras release ({keras.__version__}) has no `{what}`; "
        f"keras-mirror cannot {purpose}. Install a supported Keras (see "
        "keras_mirror._compat).")


def _require(owner, names, label, purpose):
    """Raises `_missing` unless `owner` has every attribute in `names`."""
    for name in names:
        if not hasattr(owner, name):
            raise _missing(f"{label}.{name}", purpose)


def _replace_method(obj, name, make_hook, purpose):
    """Sets `obj.<name>` to `make_hook(<the class's bound method>)`."""
    _require(obj, (name,), type(obj).__name__, purpose)
    original = getattr(type(obj), name).__get__(obj)
    setattr(obj, name, make_hook(original))


def _identity_allreduce(grads_and_vars):
    return list(grads_and_vars)


def disable_optimizer_allreduce(optimizer):
    """Stops `optimizer` (and a wrapped inner optimizer) from all-reducing."""
    replace_optimizer_allreduce(optimizer, lambda original: _identity_allreduce)


def loss_tracker(model):
    """The `Mean` metric behind `logs["loss"]`, or None before compile."""
    return getattr(model, _LOSS_TRACKER, None)


# -- models with their own `train_step` (keras_mirror._custom_step) ---------

# Inside a `tf.distribute` strategy, Keras divides every reduced loss by the
# replica count (`keras.src.losses.loss.scale_loss_for_distribution`, used by
# `Loss.__call__` and `Model.compute_loss`; `unscale_loss_for_distribution`
# undoes it for the loss trackers). A user's own `train_step` run per replica
# must see the loss one device computes on its shard, so that keras-mirror
# can weight the gradients by the shard's share of the global batch instead;
# both functions are replaced by the identity while the replicas' steps are
# traced.
_LOSS_MODULE = "keras.src.losses.loss"
_LOSS_SCALERS = ("scale_loss_for_distribution", "unscale_loss_for_distribution")


def _loss_module():
    import importlib

    return importlib.import_module(_LOSS_MODULE)


def _identity(value):
    return value


@contextlib.contextmanager
def unscaled_losses():
    """Within the block, Keras losses are not divided by the replica count."""
    module = _loss_module()
    saved = {}
    for name in _LOSS_SCALERS:
        _require(module, (name,), _LOSS_MODULE,
                 "compute a replica's own loss exactly")
        saved[name] = getattr(module, name)
    try:
        for name in _LOSS_SCALERS:
            setattr(module, name, _identity)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def replace_optimizer_allreduce(optimizer, make_hook):
    """Replaces the gradient all-reduce of `optimizer` (and its inner one).

    `make_hook(original)` receives the optimizer's own bound
    `_all_reduce_sum_gradients` and returns the function that takes its
    place (same contract: a list of `(gradient, variable)` pairs in, the
    all-reduced list out).
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None:
            continue
        _replace_method(opt, _ALLREDUCE_HOOK, make_hook,
                        "replace the optimizer's own gradient all-reduce")


# An optimizer clips (`clipnorm`, `global_clipnorm`, `clipvalue`) in
# `_clip_gradients`, before its all-reduce hook. In a model's own `train_step`
# keras-mirror all-reduces there instead, so that clipping sees the global
# gradient, as on one device.
_CLIP_HOOK = "_clip_gradients"


def replace_optimizer_clip(optimizer, make_hook):
    """Replaces `optimizer._clip_gradients` by `make_hook(original)`."""
    _replace_method(optimizer, _CLIP_HOOK, make_hook,
                    "all-reduce gradients before clipping")


def symbolic_build(model, data_batch):
    """Builds the model, compiled loss and compiled metrics from a batch."""
    getattr(model, _SYMBOLIC_BUILD)(data_batch=data_batch)


# -- masks (keras_mirror.steps.arithmetic, steps.in_graph) ----------------

# A masking layer (`Embedding(mask_zero=True)`, `Masking`) marks its output
# with a mask that Keras keeps on the tensor itself; the compiled loss divides
# a masked output's loss by the number of unmasked entries, and the compiled
# metrics skip masked entries. keras-mirror reads each shard's mask to weight
# the shard by its share of the unmasked entries (not of the rows), and sets
# the concatenated mask on the concatenated predictions, so that loss and
# metrics equal one device's. Keras exposes no public accessor for it.
_MASK_MODULE = "keras.src.backend.common.masking"


def _masking():
    import importlib

    module = importlib.import_module(_MASK_MODULE)
    _require(module, ("get_keras_mask", "set_keras_mask"), _MASK_MODULE,
             "weight masked losses exactly")
    return module


def get_mask(tensor):
    """The Keras mask of `tensor`, or None."""
    return _masking().get_keras_mask(tensor)


def set_mask(tensor, mask):
    """Marks `tensor` with the Keras mask `mask` (in place)."""
    _masking().set_keras_mask(tensor, mask)


# -- tf.distribute's multi-worker strategy (keras_mirror.devices) ------------

# `MultiWorkerMirroredStrategy` takes no device list: it puts one replica on
# `CPU:0` of a worker without GPUs, and one on every GPU otherwise. To give a
# worker exactly the devices asked for (2 logical CPUs per worker for
# development and CI, or a subset of its GPUs), keras-mirror subclasses the
# strategy's extended class and overrides its local-device discovery, which
# `__init__` calls with the worker's device prefix
# (`/job:worker/task:i`) and which returns `(devices, device_type)`.
_TF_COLLECTIVE_MODULE = (
    "tensorflow.python.distribute.collective_all_reduce_strategy")
_TF_COLLECTIVE_EXTENDED = "CollectiveAllReduceExtended"
_TF_LOCAL_DEVICES_HOOK = "_initialize_local_devices"
# The same prefix, kept by the extended strategy: it tells which of the
# logical devices TensorFlow lists (every worker's, once a cluster is up) are
# this process's own.
_TF_WORKER_DEVICE = "_worker_device"


def _collective_extended_base():
    import importlib

    module = importlib.import_module(_TF_COLLECTIVE_MODULE)
    base = getattr(module, _TF_COLLECTIVE_EXTENDED, None)
    if base is None or not hasattr(base, _TF_LOCAL_DEVICES_HOOK):
        import tensorflow as tf

        raise RuntimeError(
            f"This TensorFlow release ({tf.__version__}) has no "
            f"`{_TF_COLLECTIVE_EXTENDED}.{_TF_LOCAL_DEVICES_HOOK}`; "
            "keras-mirror cannot choose a worker's devices for "
            "MultiWorkerMirroredStrategy. Install a supported TensorFlow "
            "(see keras_mirror._compat).")
    return base


def collective_extended_on(device_type, indices):
    """A `CollectiveAllReduceExtended` whose replicas are the given devices.

    The worker's replicas are `<worker>/device:<device_type>:<i>` for each
    `i` in `indices`, in that order.
    """
    indices = tuple(indices)

    def local_devices(self, cluster_resolver, worker_device):
        del cluster_resolver  # the devices are given
        return tuple(f"{worker_device}/device:{device_type}:{i}"
                     for i in indices), device_type

    return type("CollectiveAllReduceExtendedOnDevices",
                (_collective_extended_base(),),
                {_TF_LOCAL_DEVICES_HOOK: local_devices})


def worker_device(strategy):
    """The worker device prefix (`/job:worker/task:i`) of `strategy`."""
    return getattr(strategy.extended, _TF_WORKER_DEVICE)


# -- the user's variables, re-homed in place (keras_mirror._homes) ------------

# A Keras variable (`keras.Variable`, TF backend) keeps its TensorFlow variable
# in `_value` and creates it in `_initialize(value)`, with the aggregation and
# synchronization Keras chose. keras-mirror trains the user's own model object
# on a `MirroredStrategy` by giving each of its variables a second backing
# variable made by `_initialize` inside the strategy's scope (a
# `MirroredVariable`, the value kept), and switches between the two: mirrored
# while the wrapper trains, single-device otherwise, so that the user's
# `model.fit`/`predict` keep working on one device. Keras has no public way to
# re-home a variable.
_VARIABLE_BACKING = "_value"
_VARIABLE_INITIALIZE = "_initialize"


def _check_variable_api(variable):
    _require(variable, (_VARIABLE_BACKING, _VARIABLE_INITIALIZE), "Variable",
             "train the model's own variables on a tf.distribute strategy")


def backing(variable):
    """The TensorFlow variable behind a Keras variable."""
    _check_variable_api(variable)
    return getattr(variable, _VARIABLE_BACKING)


def set_backing(variable, tf_variable):
    """Makes `tf_variable` the one behind the Keras `variable`."""
    _check_variable_api(variable)
    setattr(variable, _VARIABLE_BACKING, tf_variable)


def new_backing(variable, value):
    """A new TF variable for `variable` (in the current scope), not installed.

    It has the Keras variable's dtype, aggregation and synchronization, and
    the current backing's own `trainable` flag: the one TensorFlow's tape
    reads, fixed when the backing was made (a layer frozen then unfrozen
    keeps it), so that gradients flow exactly where they flow on one
    device. Created inside a strategy's scope it is distributed.
    """
    current = backing(variable)
    keras_trainable = variable.trainable
    try:
        variable.trainable = getattr(current, "trainable", keras_trainable)
        getattr(variable, _VARIABLE_INITIALIZE)(value)
        return backing(variable)
    finally:
        variable.trainable = keras_trainable
        set_backing(variable, current)


# -- keras.random draws inside a replica (keras_mirror._random) ---------------

# Keras's random functions (`keras.random.*`, Dropout, GaussianNoise, ...)
# call the TF backend's module `keras.src.backend.tensorflow.random` at call
# time, through the `backend.random` attribute. keras-mirror replaces its
# shape-taking functions while a replica step is traced, so that a draw whose
# leading dimension is the replica's shard draws the global batch's rows (same
# seed, same generator advance) and keeps this shard's: exactly one device's
# numbers. The names replaced are checked here.
_RANDOM_MODULE = "keras.src.backend.tensorflow.random"
RANDOM_FUNCTIONS = ("normal", "uniform", "truncated_normal", "randint",
                    "dropout", "gamma", "binomial", "beta", "categorical",
                    "shuffle")


def random_module():
    """The TF backend's random module, checked for the functions replaced."""
    import importlib

    module = importlib.import_module(_RANDOM_MODULE)
    _require(module, RANDOM_FUNCTIONS + ("_cast_seed", "draw_seed"),
             _RANDOM_MODULE,
             "make random draws inside a replica equal one device's")
    return module


# Synchronized BatchNormalization computes its moments through the TF
# backend's `nn.moments(..., synchronized=True)`, which calls the module's
# `_compute_moments_sync` at call time: local sums and counts, all-reduced.
# keras-mirror replaces it inside replica steps so that a stand-in replica
# (an empty shard running one row, `steps/_stand_in.py`) adds nothing.
_NN_MODULE = "keras.src.backend.tensorflow.nn"
SYNC_MOMENTS = "_compute_moments_sync"


def moments_module():
    """The TF backend's nn module, checked for the synchronized moments."""
    import importlib

    module = importlib.import_module(_NN_MODULE)
    _require(module, (SYNC_MOMENTS, "moments"), _NN_MODULE,
             "leave empty shards out of synchronized BatchNorm statistics")
    return module


@contextlib.contextmanager
def replaced(module, replacements):
    """Within the block, `module.<name>` is `replacements[name]`."""
    saved = {name: getattr(module, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(module, name, fn)
        yield saved
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


# Keras's compiled loss updates one `Mean` tracker per output with
# `sample_weight=<the batch's static row count>`, which a shard of dynamic
# size does not have (None: every shard then weighs 1, a mean of shard
# means). `CompileLoss.metrics` lists those trackers; `Trainer._compile_loss`
# is the compiled loss.
_COMPILE_LOSS = "_compile_loss"


def output_loss_trackers(model):
    """The per-output loss `Mean`s of `model`'s compiled loss (maybe [])."""
    compile_loss = getattr(model, _COMPILE_LOSS, None)
    if compile_loss is None:
        return []
    return list(getattr(compile_loss, "metrics", []) or [])


def has_compiled_loss_or_metrics(model):
    """Whether `model.compile` gave it a compiled loss or metrics."""
    return getattr(model, _COMPILE_LOSS, None) is not None or getattr(
        model, "_compile_metrics", None) is not None


# A compiled loss (`CompileLoss`) computes each output's term in a loop over
# `_flat_losses`, namedtuples `(path, loss, loss_weights, name)` made on its
# first call, and logs each term with the `Mean` of the same index in
# `metrics`. keras-mirror lends it a list whose losses also report their
# value, to weight each output's term by its own reduction. A built-in loss
# (`keras.src.losses.losses.LossFunctionWrapper`, which also wraps a loss
# given by name) applies a Keras loss function to each sample, then reduces.
_FLAT_LOSSES = "_flat_losses"
_LOSS_WRAPPER = ("keras.src.losses.losses", "LossFunctionWrapper")


def flat_losses(model):
    """The compiled loss's `(path, loss, loss_weights, name)` list, or None."""
    compile_loss = getattr(model, _COMPILE_LOSS, None)
    return None if compile_loss is None else getattr(
        compile_loss, _FLAT_LOSSES, None)


@contextlib.contextmanager
def reporting_flat_losses(model, report):
    """Within the block, output `i`'s loss value `v` also calls `report(i, v)`.
    """
    entries = flat_losses(model)
    if not entries:
        yield
        return
    compile_loss = getattr(model, _COMPILE_LOSS)

    def reporting(i, loss):
        def call(*args, **kwargs):
            value = loss(*args, **kwargs)
            report(i, value)
            return value
        return call

    setattr(compile_loss, _FLAT_LOSSES, [
        e._replace(loss=reporting(i, e.loss)) for i, e in enumerate(entries)])
    try:
        yield
    finally:
        setattr(compile_loss, _FLAT_LOSSES, entries)


def keras_per_sample_loss(loss):
    """Whether `loss` is a built-in Keras loss of per-sample values."""
    import importlib

    module, name = _LOSS_WRAPPER
    wrapper = getattr(importlib.import_module(module), name)
    fn = getattr(loss, "fn", None)
    return (isinstance(loss, wrapper) and type(loss).call is wrapper.call
            and getattr(fn, "__module__", "").startswith("keras.")
            and getattr(keras.losses, getattr(fn, "__name__", ""),
                        None) is fn)


# `Layer._flatten_layers()` walks a model's layers (itself first) in the order
# `Layer.losses` collects their `add_loss` terms, which each layer keeps in
# `_losses`. Used only to name the layer of an `add_loss` term in an error.
_FLATTEN_LAYERS = "_flatten_layers"
_OWN_LOSSES = "_losses"


def loss_owners(model):
    """`"layer 'name'"` for each `add_loss` term, in `model.losses` order."""
    owners = []
    for layer in getattr(model, _FLATTEN_LAYERS)(include_self=True):
        own = getattr(layer, _OWN_LOSSES, None) or []
        owners.extend([f"layer {layer.name!r}"] * len(own))
    return owners


# A TF-backend optimizer finds a variable's slots through
# `_trainable_variables_indices`, keyed by `_var_key(variable)`: the unique id
# of the TF variable behind it. When `_homes` switches a variable's backing,
# the keys must follow, from the optimizer's own `_trainable_variables`.
_OPT_INDICES = "_trainable_variables_indices"
_OPT_VARIABLES = "_trainable_variables"


def rekey_optimizer(optimizer):
    """Re-indexes `optimizer` (and an inner one) by the current backings."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or not getattr(opt, "built", False):
            continue
        _require(opt, (_OPT_INDICES, _OPT_VARIABLES, "_var_key"),
                 type(opt).__name__,
                 "train the model's own optimizer on a strategy")
        setattr(opt, _OPT_INDICES, {
            opt._var_key(v): i
            for i, v in enumerate(getattr(opt, _OPT_VARIABLES))})


# -- virtual shards of a tf.data pipeline (distribute/_virtual_shards.py) ---

# TensorFlow shards a pipeline by its files only inside
# `experimental_distribute_dataset`, for the strategy's workers. A virtual
# shard is one such shard for a fixed count `V`, whatever the number of
# workers: `_AutoShardDataset(dataset, V, v)` applies the same graph rewrite
# (files `v, v + V, ...`, or a `SHARD_HINT`), with the policy in the
# dataset's options. The pipeline's graph (`_as_serialized_graph`) says which
# files it reads, its batch size and whether a `shuffle` has a seed.
_AUTO_SHARD_MODULE = "tensorflow.python.data.experimental.ops.distribute"
_AUTO_SHARD = "_AutoShardDataset"
_DATASET_GRAPH = "_as_serialized_graph"


def auto_shard(dataset, num_shards, index):
    """`dataset`'s shard `index` of `num_shards`, as TF's auto-sharding."""
    import importlib

    module = importlib.import_module(_AUTO_SHARD_MODULE)
    _require(module, (_AUTO_SHARD,), _AUTO_SHARD_MODULE,
             "shard a tf.data pipeline into virtual shards")
    return getattr(module, _AUTO_SHARD)(dataset, num_shards, index)


def dataset_graph(dataset):
    """The `GraphDef` of a `tf.data.Dataset`'s pipeline."""
    from tensorflow.core.framework import graph_pb2

    _require(dataset, (_DATASET_GRAPH,), "tf.data.Dataset",
             "read a tf.data pipeline's files and batch size")
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(getattr(dataset, _DATASET_GRAPH)().numpy())
    return graph


# Keras keeps the generator that unseeded `keras.random` calls draw from in
# its global state, created on first use; `verify` restores its state.
_GLOBAL_STATE_MODULE = "keras.src.backend.common.global_state"
_GLOBAL_SEED_GENERATOR = "global_seed_generator"


def global_seed_generator():
    """Keras's global `SeedGenerator`, or None when none was made yet."""
    import importlib

    module = importlib.import_module(_GLOBAL_STATE_MODULE)
    _require(module, ("get_global_attribute",), _GLOBAL_STATE_MODULE,
             "restore the global seed generator after `verify`")
    return module.get_global_attribute(_GLOBAL_SEED_GENERATOR)
