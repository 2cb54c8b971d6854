"""In-batch negatives (SimCLR / CLIP style), exact with `all_gather`.

A contrastive loss scores each row against every other row of the batch:
the batch is part of the loss. Computed on each replica's shard, the
negatives are the shard's rows only, and training differs from one device
(keras-mirror warns of it at the first step).
`keras_mirror.replica_context().all_gather(z)` gives every replica the
global batch's rows, with the gradient routed back to each replica's own
rows, so the loss is one device's. This script trains the same model on one
device, on 4 replicas with `all_gather`, and on 4 replicas without it, on
synthetic pairs of views, and prints how far the weights are apart.

Two losses: `--loss infonce` (CLIP's symmetric InfoNCE, each view against
the other) and `--loss nt-xent` (SimCLR's NT-Xent: both views' rows against
all 2B rows but themselves).

    python examples/contrastive.py --epochs 2
    python examples/contrastive.py --loss nt-xent --rows 26 --batch-size 8
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_mirror  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=14)
    parser.add_argument("--rows", type=int, default=60,
                        help="training pairs (60 leaves an uneven batch)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--loss", choices=sorted(LOSSES), default="infonce")
    return parser.parse_args(argv)


def make_data(rows, features=8, seed=0):
    """Two noisy views of the same synthetic points: (view_a, view_b)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    points = rng.normal(size=(rows, features)).astype("float32")
    noise = 0.1 * rng.normal(size=(2, rows, features)).astype("float32")
    return points + noise[0], points + noise[1]


def contrastive_loss(za, zb, gather=True, temperature=0.2):
    """Symmetric InfoNCE: row i of one view against every row of the other.

    With `gather`, the negatives are the global batch's rows
    (`all_gather`), and row i's positive is its global row, `offset + i`.
    Outside `MirroredModel` both are the batch itself, as on one device.
    """
    import keras

    ops = keras.ops
    ctx = keras_mirror.replica_context()
    if gather:
        all_a, all_b, first = ctx.all_gather(za), ctx.all_gather(zb), \
            ctx.offset
    else:
        all_a, all_b, first = za, zb, 0
    labels = first + ops.arange(ops.shape(za)[0])
    losses = [
        keras.losses.sparse_categorical_crossentropy(
            labels, ops.matmul(mine, ops.transpose(others)) / temperature,
            from_logits=True)
        for mine, others in ((za, all_b), (zb, all_a))]
    return (ops.mean(losses[0]) + ops.mean(losses[1])) / 2


def nt_xent_loss(za, zb, gather=True, temperature=0.5):
    """SimCLR's NT-Xent: each of the 2B rows against the other 2B - 1.

    Row i of view a has its positive in row i of view b, and the other
    2B - 2 rows of both views are its negatives. One device builds the
    [2B, 2B] similarity matrix; on a replica, its 2b rows (both views of
    its shard) are scored against all 2B rows (`all_gather`), a [2b, 2B]
    block of that matrix, and the mean over its rows, weighted by the
    replica's share of the batch, sums to one device's mean over 2B rows.
    """
    import keras

    ops = keras.ops
    ctx = keras_mirror.replica_context()
    if gather:
        all_a, all_b, first = ctx.all_gather(za), ctx.all_gather(zb), \
            ctx.offset
    else:
        all_a, all_b, first = za, zb, 0
    rows, total = ops.shape(za)[0], ops.shape(all_a)[0]
    anchors = ops.concatenate([za, zb], axis=0)  # [2b, d]
    others = ops.concatenate([all_a, all_b], axis=0)  # [2B, d]
    logits = ops.matmul(anchors, ops.transpose(others)) / temperature
    # The anchors' own global rows (view a, then view b), and their
    # positives: the same example's row in the other view.
    mine = first + ops.arange(rows)
    own = ops.concatenate([mine, mine + total], axis=0)
    positives = ops.concatenate([mine + total, mine], axis=0)
    logits = logits - 1e9 * ops.one_hot(own, 2 * total)
    return ops.mean(keras.losses.sparse_categorical_crossentropy(
        positives, logits, from_logits=True))


LOSSES = {"infonce": contrastive_loss, "nt-xent": nt_xent_loss}


def make_model(gather=True, seed=0, loss="infonce"):
    """A small encoder trained by its own `train_step` (keras.io style),
    on `loss` (a key of `LOSSES`)."""
    import keras
    import tensorflow as tf

    loss_fn = LOSSES[loss]

    class Contrastive(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.encoder = keras.Sequential([
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(4),
            ], name="encoder")
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def call(self, x):
            return self.encoder(x)

        @property
        def metrics(self):
            return [self.loss_tracker]

        def embed(self, x):
            return keras.ops.normalize(self.encoder(x, training=True),
                                       axis=-1)

        def train_step(self, data):
            view_a, view_b = data
            with tf.GradientTape() as tape:
                loss = loss_fn(self.embed(view_a), self.embed(view_b),
                               gather)
            variables = self.encoder.trainable_weights
            grads = tape.gradient(loss, variables)
            self.optimizer.apply_gradients(zip(grads, variables))
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    keras.utils.set_random_seed(seed)
    model = Contrastive()
    model(keras.ops.zeros((1, 8)))
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    return model


def train(args, replicas, gather):
    """Trains from seed 0; returns (model, History)."""
    a, b = make_data(args.rows)
    model = make_model(gather, loss=args.loss)
    target = keras_mirror.MirroredModel(model, devices=replicas) \
        if replicas else model
    history = target.fit(a, b, batch_size=args.batch_size,
                         epochs=args.epochs, shuffle=False, verbose=0)
    return model, history


def max_diff(a, b):
    import numpy as np

    return max(float(np.max(np.abs(u - v)))
               for u, v in zip(a.get_weights(), b.get_weights()))


def main(argv=None):
    args = parse_args(argv)
    devices = keras_mirror.logical_cpus(args.replicas)
    single, h1 = train(args, None, True)
    gathered, h2 = train(args, devices, True)
    local, _ = train(args, devices, False)
    print(f"{args.loss}, one device: final loss "
          f"{h1.history['loss'][-1]:.6f}")
    print(f"{args.replicas} replicas, all_gather: final loss "
          f"{h2.history['loss'][-1]:.6f}")
    print(f"max weight difference with all_gather: "
          f"{max_diff(single, gathered):.3g}")
    print(f"max weight difference, shard-local negatives: "
          f"{max_diff(single, local):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
