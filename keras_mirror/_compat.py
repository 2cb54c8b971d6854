"""Every private Keras attribute that keras-mirror relies on, in one place.

Keras 3 has no public hook for two things that exact data-parallel training
needs. Each access below says why; `tests/test_compat.py` has one test per
attribute, so that a Keras release that renames or removes one fails loudly
there instead of silently counting gradients `N` times.

Supported range: Keras 3.14 and 3.15 (3.14 brought the 2025-2026 fixes to
safe-mode loading that keras-mirror's saving relies on).
"""

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


def _identity_allreduce(grads_and_vars):
    return list(grads_and_vars)


def disable_optimizer_allreduce(optimizer):
    """Stops `optimizer` (and a wrapped inner optimizer) from all-reducing."""
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None:
            continue
        if not hasattr(opt, _ALLREDUCE_HOOK):
            raise RuntimeError(
                f"This Keras release ({keras.__version__}) has no "
                f"`{type(opt).__name__}.{_ALLREDUCE_HOOK}`; keras-mirror "
                "cannot stop the optimizer's own gradient all-reduce. "
                "Install a supported Keras (see keras_mirror._compat)."
            )
        setattr(opt, _ALLREDUCE_HOOK, _identity_allreduce)


def loss_tracker(model):
    """The `Mean` metric behind `logs["loss"]`, or None before compile."""
    return getattr(model, _LOSS_TRACKER, None)
