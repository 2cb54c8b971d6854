"""Split rules and device resolution."""

import pytest
import tensorflow as tf

import keras_mirror
from keras_mirror import devices
from keras_mirror import split


def test_balanced_and_fill_rules():
    assert split.balanced_sizes(10, 4) == (3, 3, 2, 2)
    assert split.balanced_sizes(3, 4) == (1, 1, 1, 0)
    assert split.fill_sizes(13, 4, 4) == (4, 4, 4, 1)
    assert split.fill_sizes(2, 4, 4) == (2, 0, 0, 0)
    for b in range(0, 30):
        for n in range(1, 6):
            assert sum(split.balanced_sizes(b, n)) == b
            assert split.sizes_tensor(b, n).numpy().tolist() == list(
                split.balanced_sizes(b, n))
            assert split.sizes_tensor(b, n, 3).numpy().tolist() == list(
                split.fill_sizes(b, n, 3))


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
