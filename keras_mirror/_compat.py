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
        if not hasattr(module, name):
            raise RuntimeError(
                f"This Keras release ({keras.__version__}) has no "
                f"`{_LOSS_MODULE}.{name}`; keras-mirror cannot run a custom "
                "`train_step` per replica exactly. Install a supported Keras "
                "(see keras_mirror._compat).")
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
        if not hasattr(opt, _ALLREDUCE_HOOK):
            raise RuntimeError(
                f"This Keras release ({keras.__version__}) has no "
                f"`{type(opt).__name__}.{_ALLREDUCE_HOOK}`; keras-mirror "
                "cannot replace the optimizer's own gradient all-reduce. "
                "Install a supported Keras (see keras_mirror._compat).")
        original = getattr(type(opt), _ALLREDUCE_HOOK).__get__(opt)
        setattr(opt, _ALLREDUCE_HOOK, make_hook(original))


def symbolic_build(model, data_batch):
    """Builds the model, compiled loss and compiled metrics from a batch."""
    getattr(model, _SYMBOLIC_BUILD)(data_batch=data_batch)


# -- masks (keras_mirror._steps, _graph_steps) ------------------------------

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
    for name in ("get_keras_mask", "set_keras_mask"):
        if not hasattr(module, name):
            raise RuntimeError(
                f"This Keras release ({keras.__version__}) has no "
                f"`{_MASK_MODULE}.{name}`; keras-mirror cannot weight masked "
                "losses exactly. Install a supported Keras (see "
                "keras_mirror._compat).")
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
