"""`distribute.devices`: logical CPUs, device names, one strategy per set.

Also the tests of `keras_mirror/distribute/_strategies.py`.
"""

import pytest
import tensorflow as tf

import keras_mirror
from keras_mirror import devices


def test_logical_cpus_is_idempotent_and_refuses_another_count(cpus):
    assert keras_mirror.logical_cpus(4) == cpus
    with pytest.raises(keras_mirror.errors.DevicesAlreadyInitializedError,
                       match="Received: n=2"):
        keras_mirror.logical_cpus(2)
    with pytest.raises(ValueError, match="Received: n=0"):
        keras_mirror.logical_cpus(0)


def test_resolve_devices(cpus):
    assert devices.resolve_devices(None) == cpus
    assert devices.resolve_devices(["/cpu:2", "CPU:0"]) == [cpus[2], cpus[0]]
    logical = tf.config.list_logical_devices("CPU")
    assert devices.resolve_devices(logical[1:3]) == cpus[1:3]
    with pytest.raises(ValueError, match=r"Received: devices=\[\]"):
        devices.resolve_devices([])
    with pytest.raises(ValueError, match="unknown device '/gpu:0'"):
        devices.resolve_devices(["/gpu:0"])
    with pytest.raises(ValueError, match="twice"):
        devices.resolve_devices(["/cpu:0", "/device:CPU:0"])


def test_one_strategy_per_device_set(cpus):
    a = devices.mirrored_strategy(cpus[:2])
    assert devices.mirrored_strategy(cpus[:2]) is a
    assert isinstance(a, tf.distribute.MirroredStrategy)
    assert a.num_replicas_in_sync == 2
