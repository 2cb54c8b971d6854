"""`keras_mirror.split`: the split rules, checked by examples and properties.

The balanced rule (global batches) and the fill rule (`batch="per_replica"`)
are partitions of the batch; their tensor twin (`sizes_tensor`, used inside
the steps) agrees with them. Pure Python: many cheap examples.
"""

import numpy as np
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from keras_mirror import split

PURE = settings(max_examples=300, deadline=None)


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


@PURE
@given(st.integers(0, 1000), st.integers(1, 16))
def test_balanced_sizes_partition(batch_size, n):
    sizes = split.balanced_sizes(batch_size, n)
    assert len(sizes) == n and sum(sizes) == batch_size
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)
    assert sizes.count(0) == max(0, n - batch_size)
    # Contiguous shards rebuild the batch in order, each row once.
    offsets = np.cumsum((0,) + sizes)
    rows = [r for i in range(n) for r in range(offsets[i], offsets[i + 1])]
    assert rows == list(range(batch_size))


@PURE
@given(st.integers(1, 16), st.integers(1, 64), st.data())
def test_fill_sizes_partition(n, capacity, data):
    batch_size = data.draw(st.integers(0, n * capacity))
    sizes = split.fill_sizes(batch_size, n, capacity)
    assert len(sizes) == n and sum(sizes) == batch_size
    assert all(0 <= s <= capacity for s in sizes)
    full, rest = divmod(batch_size, capacity)
    assert sizes[:full] == (capacity,) * full
    assert all(s == 0 for s in sizes[full + (rest > 0):])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(1, 8), st.integers(1, 40))
def test_sizes_tensor_matches_python(batch_size, n, capacity):
    balanced = split.sizes_tensor(batch_size, n).numpy().tolist()
    assert tuple(balanced) == split.balanced_sizes(batch_size, n)
    batch_size = min(batch_size, n * capacity)
    filled = split.sizes_tensor(batch_size, n, capacity).numpy().tolist()
    assert tuple(filled) == split.fill_sizes(batch_size, n, capacity)


def test_a_batch_larger_than_the_capacity_is_never_clipped():
    assert split.fill_sizes(32, 4, 4) == (8, 8, 8, 8)
    assert split.fill_sizes(14, 4, 4) == (4, 4, 4, 2)
    assert tuple(split.sizes_tensor(33, 4, 4).numpy()) == (9, 9, 9, 6)
    assert tuple(split.sizes_tensor(14, 4, 4).numpy()) == (4, 4, 4, 2)


def test_growing_per_replica_batches_train_as_the_joined_batches(cpus):
    import keras
    import tensorflow as tf
    from support.helpers import max_diff
    from support.helpers import mlp

    import keras_mirror

    rng = np.random.default_rng(0)
    sizes = [4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 8, 3]
    x = rng.normal(size=(sum(sizes), 6)).astype("float32")
    y = rng.normal(size=(sum(sizes), 3)).astype("float32")
    ends = np.cumsum(sizes)

    def elements(groups):
        starts = np.concatenate([[0], ends[:-1]])
        cut = [(x[a:b], y[a:b]) for a, b in zip(starts, ends)]
        if groups == 1:
            return cut
        return [tuple(np.concatenate(p) for p in zip(*cut[i:i + 4]))
                for i in range(0, len(cut), 4)]

    def dataset(parts):
        return tf.data.Dataset.from_generator(
            lambda: iter(parts),
            output_signature=(tf.TensorSpec((None, 6), tf.float32),
                              tf.TensorSpec((None, 3), tf.float32)))

    single = mlp()
    single.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    single.fit(dataset(elements(4)), epochs=2, verbose=0)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    mirrored = keras_mirror.MirroredModel(model, devices=cpus,
                                          batch="per_replica")
    mirrored.fit(dataset(elements(1)), epochs=2, verbose=0)
    assert (mirrored.optimizer.iterations.numpy()
            == single.optimizer.iterations.numpy())
    assert max_diff(single.get_weights(), model.get_weights()) < 1e-5
