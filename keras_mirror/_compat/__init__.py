"""Every private Keras and TensorFlow attribute keras-mirror relies on.

Keras 3 has no public hook for two things that exact data-parallel training
needs, and TensorFlow's `MultiWorkerMirroredStrategy` none for choosing a
worker's devices. Each access below says why; `tests/compat/` has one
test per attribute, so that a Keras or TensorFlow release that renames or
removes one fails loudly there instead of silently counting gradients `N`
times or training on the wrong devices.

Supported range: Keras 3.14 and 3.15 (3.14 brought the 2025-2026 fixes to
safe-mode loading that keras-mirror's saving relies on).

By owner: `keras_training` (Keras's trainer, optimizers, losses and
compiled metrics), `keras_backend` (variables, masks, random draws, the TF
backend's functions), `tf_distribute` (TensorFlow's strategies and
`tf.data` sharding), `tf_kernels` (whether oneDNN runs); `_base` holds the
version range and the checks. Every name is re-exported here: callers write
`_compat.<name>`.
"""

from keras_mirror._compat._base import SUPPORTED_KERAS as SUPPORTED_KERAS
from keras_mirror._compat._base import _missing as _missing
from keras_mirror._compat._base import _require as _require
from keras_mirror._compat._base import check_backend as check_backend
from keras_mirror._compat._base import (
    check_keras_version as check_keras_version,
)
from keras_mirror._compat._base import keras_version as keras_version
from keras_mirror._compat._base import note_replaced as note_replaced
from keras_mirror._compat._base import recording as recording
from keras_mirror._compat._base import replaced as replaced
from keras_mirror._compat._base import replaced_method as replaced_method
from keras_mirror._compat.keras_backend import (
    _BACKEND_MODULE as _BACKEND_MODULE,
)
from keras_mirror._compat.keras_backend import (
    _GLOBAL_SEED_GENERATOR as _GLOBAL_SEED_GENERATOR,
)
from keras_mirror._compat.keras_backend import (
    _GLOBAL_STATE_MODULE as _GLOBAL_STATE_MODULE,
)
from keras_mirror._compat.keras_backend import _MASK_MODULE as _MASK_MODULE
from keras_mirror._compat.keras_backend import _NN_MODULE as _NN_MODULE
from keras_mirror._compat.keras_backend import _RANDOM_MODULE as _RANDOM_MODULE
from keras_mirror._compat.keras_backend import (
    _VARIABLE_BACKING as _VARIABLE_BACKING,
)
from keras_mirror._compat.keras_backend import (
    _VARIABLE_INITIALIZE as _VARIABLE_INITIALIZE,
)
from keras_mirror._compat.keras_backend import LOCAL_MOMENTS as LOCAL_MOMENTS
from keras_mirror._compat.keras_backend import (
    RANDOM_FUNCTIONS as RANDOM_FUNCTIONS,
)
from keras_mirror._compat.keras_backend import SYNC_MOMENTS as SYNC_MOMENTS
from keras_mirror._compat.keras_backend import (
    _check_variable_api as _check_variable_api,
)
from keras_mirror._compat.keras_backend import _masking as _masking
from keras_mirror._compat.keras_backend import backing as backing
from keras_mirror._compat.keras_backend import (
    compute_output_spec as compute_output_spec,
)
from keras_mirror._compat.keras_backend import get_mask as get_mask
from keras_mirror._compat.keras_backend import (
    global_seed_generator as global_seed_generator,
)
from keras_mirror._compat.keras_backend import (
    made_global_seed_generator as made_global_seed_generator,
)
from keras_mirror._compat.keras_backend import moments_module as moments_module
from keras_mirror._compat.keras_backend import new_backing as new_backing
from keras_mirror._compat.keras_backend import random_module as random_module
from keras_mirror._compat.keras_backend import set_backing as set_backing
from keras_mirror._compat.keras_backend import set_mask as set_mask
from keras_mirror._compat.keras_training import (
    _ALLREDUCE_HOOK as _ALLREDUCE_HOOK,
)
from keras_mirror._compat.keras_training import _COMPILE_LOSS as _COMPILE_LOSS
from keras_mirror._compat.keras_training import _FLAT_LOSSES as _FLAT_LOSSES
from keras_mirror._compat.keras_training import (
    _FLATTEN_LAYERS as _FLATTEN_LAYERS,
)
from keras_mirror._compat.keras_training import _LOSS_MODULE as _LOSS_MODULE
from keras_mirror._compat.keras_training import _LOSS_SCALERS as _LOSS_SCALERS
from keras_mirror._compat.keras_training import _LOSS_TRACKER as _LOSS_TRACKER
from keras_mirror._compat.keras_training import _LOSS_WRAPPER as _LOSS_WRAPPER
from keras_mirror._compat.keras_training import _MERGE_CALL as _MERGE_CALL
from keras_mirror._compat.keras_training import _OPT_INDICES as _OPT_INDICES
from keras_mirror._compat.keras_training import _OPT_VARIABLES as _OPT_VARIABLES
from keras_mirror._compat.keras_training import _OWN_LOSSES as _OWN_LOSSES
from keras_mirror._compat.keras_training import (
    _SYMBOLIC_BUILD as _SYMBOLIC_BUILD,
)
from keras_mirror._compat.keras_training import INITIAL_EPOCH as INITIAL_EPOCH
from keras_mirror._compat.keras_training import _identity as _identity
from keras_mirror._compat.keras_training import (
    _identity_allreduce as _identity_allreduce,
)
from keras_mirror._compat.keras_training import _loss_module as _loss_module
from keras_mirror._compat.keras_training import (
    compile_metrics as compile_metrics,
)
from keras_mirror._compat.keras_training import (
    disable_optimizer_allreduce as disable_optimizer_allreduce,
)
from keras_mirror._compat.keras_training import (
    distributes_through as distributes_through,
)
from keras_mirror._compat.keras_training import flat_losses as flat_losses
from keras_mirror._compat.keras_training import (
    has_compiled_loss_or_metrics as has_compiled_loss_or_metrics,
)
from keras_mirror._compat.keras_training import (
    keras_per_sample_loss as keras_per_sample_loss,
)
from keras_mirror._compat.keras_training import layers_within as layers_within
from keras_mirror._compat.keras_training import loss_owners as loss_owners
from keras_mirror._compat.keras_training import loss_tracker as loss_tracker
from keras_mirror._compat.keras_training import (
    optimizer_trainables as optimizer_trainables,
)
from keras_mirror._compat.keras_training import (
    output_loss_trackers as output_loss_trackers,
)
from keras_mirror._compat.keras_training import (
    rekey_optimizer as rekey_optimizer,
)
from keras_mirror._compat.keras_training import (
    replace_optimizer_allreduce as replace_optimizer_allreduce,
)
from keras_mirror._compat.keras_training import (
    reporting_flat_losses as reporting_flat_losses,
)
from keras_mirror._compat.keras_training import symbolic_build as symbolic_build
from keras_mirror._compat.keras_training import (
    unscaled_losses as unscaled_losses,
)
from keras_mirror._compat.keras_training import (
    updates_in_place as updates_in_place,
)
from keras_mirror._compat.tf_distribute import _AUTO_SHARD as _AUTO_SHARD
from keras_mirror._compat.tf_distribute import (
    _AUTO_SHARD_MODULE as _AUTO_SHARD_MODULE,
)
from keras_mirror._compat.tf_distribute import _DATASET_GRAPH as _DATASET_GRAPH
from keras_mirror._compat.tf_distribute import (
    _DATASET_INPUTS as _DATASET_INPUTS,
)
from keras_mirror._compat.tf_distribute import _SHARD_COUNTS as _SHARD_COUNTS
from keras_mirror._compat.tf_distribute import (
    _TF_COLLECTIVE_EXTENDED as _TF_COLLECTIVE_EXTENDED,
)
from keras_mirror._compat.tf_distribute import (
    _TF_COLLECTIVE_MODULE as _TF_COLLECTIVE_MODULE,
)
from keras_mirror._compat.tf_distribute import (
    _TF_LOCAL_DEVICES_HOOK as _TF_LOCAL_DEVICES_HOOK,
)
from keras_mirror._compat.tf_distribute import (
    _TF_WORKER_DEVICE as _TF_WORKER_DEVICE,
)
from keras_mirror._compat.tf_distribute import (
    _collective_extended_base as _collective_extended_base,
)
from keras_mirror._compat.tf_distribute import auto_shard as auto_shard
from keras_mirror._compat.tf_distribute import (
    collective_extended_on as collective_extended_on,
)
from keras_mirror._compat.tf_distribute import dataset_graph as dataset_graph
from keras_mirror._compat.tf_distribute import has_shard_hint as has_shard_hint
from keras_mirror._compat.tf_distribute import worker_device as worker_device
from keras_mirror._compat.tf_kernels import _TF_ONEDNN_PROBE as _TF_ONEDNN_PROBE
from keras_mirror._compat.tf_kernels import _TF_PORT_MODULE as _TF_PORT_MODULE
from keras_mirror._compat.tf_kernels import onednn_by_rule as onednn_by_rule
from keras_mirror._compat.tf_kernels import onednn_enabled as onednn_enabled
