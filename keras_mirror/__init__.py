"""keras-mirror: exact data-parallel training of an existing Keras model."""

from keras_mirror.devices import logical_cpus
from keras_mirror.mirrored_model import MirroredModel
from keras_mirror.version import __version__
