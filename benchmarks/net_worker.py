"""One process of `bench_network.py`, run inside an emulated host.

usage: net_worker.py ROLE OUT.json --model M --batch B --steps S
                     --warmup K --repeats R [--variants a,b] [--pack P]

ROLE `single` fits the model on one device with the global batch B. ROLE
`cluster` is one worker of a `MultiWorkerMirroredStrategy` cluster
(`TF_CONFIG` set by the parent) and runs, in `R` interleaved rounds, the
variants:

- `comm_fp32`, `comm_bf16`: only the gradient all-reduce (tensors of the
  gradients' shapes, one bucket, as `MirroredModel` sends them), timed
  per call: the communication time without compute;
- `native`: stock Keras `fit` under the same strategy (model built in its
  scope), with the two workarounds Keras 3.15 needs (see `_native`);
- `mirror`: `MirroredModel` fp32, one all-reduce (`bytes_per_pack=0`);
- `mirror_bucket`: fp32 in buckets of P bytes, last layers first, which
  overlap with backprop;
- `mirror_serial`: the same buckets, each made to wait for every gradient
  (`allreduce._OVERLAP = False`): compute + communication, no overlap;
- `mirror_bf16`: buckets of P bytes in bfloat16;

and, at the end of every round, `compute`: a plain single-device fit of
the worker's B/W rows, no network. The round's last collective step
leaves the W workers at it together, so it is the step's compute time
under the same CPU sharing (it was W extra processes started for it).

Every fit runs `warmup + steps` batches of synthetic data, one epoch; the
step times are the differences between consecutive `on_train_batch_end`
times after the warm-up batches. Writes `{variant: [[ms, ...] per
round]}` and the bytes sent per step to OUT.json (worker 0 only, in
`cluster`); each worker writes its `compute` rounds to
OUT.json.compute<i>.json.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import keras_mirror  # noqa: E402

CLUSTER_VARIANTS = ("comm_fp32", "comm_bf16", "native", "mirror",
                    "mirror_bucket", "mirror_serial", "mirror_bf16")
TIMEOUT = 120


def build(kind):
    """`mlp`: 784-512x6-10 (1.7 M parameters, 6.9 MB of fp32 gradients);
    `convnet`: 28x28x1, Conv(32)-Pool-Conv(64)-Pool-Dense(1024)-Dense(10)
    (1.7 M parameters, nearly all in the dense head)."""
    import keras

    keras.utils.set_random_seed(1234)
    L = keras.layers
    if kind == "mlp":
        layers = [keras.Input((784,))]
        layers += [L.Dense(512, activation="relu") for _ in range(6)]
        return keras.Sequential(layers + [L.Dense(10)])
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        L.Conv2D(32, 3, activation="relu"), L.MaxPooling2D(),
        L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(),
        L.Flatten(), L.Dense(1024, activation="relu"), L.Dense(10),
    ])


def data(kind, rows):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (rows, 784) if kind == "mlp" else (rows, 28, 28, 1)
    x = rng.normal(size=shape).astype("float32")
    return x, rng.integers(0, 10, size=(rows,)).astype("int32")


def compile_args():
    import keras

    return dict(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                jit_compile=False)


class _Timer:
    def __init__(self):
        import keras

        times = self.times = []

        class Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter())

        self.callback = Callback()

    def step_ms(self, warmup):
        t = self.times[warmup:]
        return [1000 * (b - a) for a, b in zip(t, t[1:])]


def fit_ms(model, x, y, batch, warmup):
    timer = _Timer()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[timer.callback])
    return timer.step_ms(warmup)


def _native(strategy, kind, x, y, local_batch):
    """Stock Keras under `MultiWorkerMirroredStrategy`, made to run.

    Keras 3.15 fails twice there: `_maybe_symbolic_build` reduces the
    first `PerReplica` batch with `strategy.reduce(..., axis=None)`
    (keras-team/keras#20585), and `reduce_per_replica` reduces the scalar
    logs with `axis=0`. So the model is built before `fit` from a local
    batch and `_maybe_symbolic_build` is turned off, and the logs take the
    first replica's value (timing does not depend on it).
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    stock = tf_trainer.reduce_per_replica

    def first_for_logs(values, strategy, reduction):
        if reduction in ("auto", "mean"):
            reduction = "first"
        return stock(values, strategy, reduction)

    tf_trainer.reduce_per_replica = first_for_logs
    with strategy.scope():
        model = build(kind)
        model.compile(**compile_args())
        model._symbolic_build(
            data_batch=(x[:local_batch], y[:local_batch], None))
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None
    return model


def _comm(strategy, kind, gradient_dtype):
    """A function timing only the gradient all-reduce, one bucket."""
    import tensorflow as tf

    from keras_mirror import allreduce

    shapes = [tuple(v.shape) for v in build(kind).trainable_variables]
    options = allreduce.communication_options("auto", 0, TIMEOUT)

    @tf.function
    def step(seed):
        def replica():
            grads = [tf.fill(s, seed) for s in shapes]
            out = allreduce.all_reduce_sum(grads, options, gradient_dtype)
            return tf.add_n([tf.reduce_sum(g[:1]) for g in out])

        return strategy.run(replica)

    def run(steps, warmup):
        times = []
        for i in range(warmup + steps + 1):
            result = step(tf.constant(float(i)))
            strategy.experimental_local_results(result)[0].numpy()
            times.append(time.perf_counter())
        t = times[warmup:]
        return [1000 * (b - a) for a, b in zip(t, t[1:])]

    return run


def _mirror(kind, cpus, pack, gradient_dtype):
    mirrored = keras_mirror.MirroredModel(
        build(kind), devices=cpus, bytes_per_pack=pack,
        gradient_dtype=gradient_dtype, timeout_seconds=TIMEOUT)
    mirrored.compile(**compile_args())
    return mirrored


def _trace(run, logdir):
    """Profiles `run()` and returns the timeline of each of its steps.

    Per step (one `EagerLocalExecute` of the train function), in ms from
    its start: when the backprop ops (`gradient_tape/`) end, when the
    first gradient all-reduce (`CollectiveReduceV2`) starts and when the
    last one ends, and `overlap_ms`, the time the first all-reduce ran
    while backprop was still running.
    """
    import glob

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    tf.profiler.experimental.start(logdir)
    try:
        run()
    finally:
        tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb")[0],
              "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for e in line.events:
                start = line.timestamp_ns / 1e6 + e.offset_ps / 1e9
                events.append((start, start + e.duration_ps / 1e9,
                               names.get(e.metadata_id, "")))
    steps = sorted((a, b) for a, b, n in events
                   if n.startswith("EagerLocalExecute: __inference")
                   and b - a > 1)
    out = []
    for a, b in steps:
        inside = [(s - a, e - a, n) for s, e, n in events
                  if a <= s <= b]
        grads = [e for s, e, n in inside if "gradient_tape/" in n]
        colls = sorted((s, e) for s, e, n in inside
                       if n.endswith(":CollectiveReduceV2"))
        if not grads or not colls:
            continue
        out.append({"step_ms": b - a, "backprop_end_ms": max(grads),
                    "first_allreduce_start_ms": colls[0][0],
                    "last_allreduce_end_ms": max(e for _, e in colls),
                    "overlap_ms": max(0.0, max(grads) - colls[0][0])})
    return out


def cluster(args):
    from keras_mirror import allreduce

    cpus = keras_mirror.logical_cpus(1)  # builds the strategy (TF_CONFIG)
    spec = keras_mirror.cluster.cluster_from_env()
    strategy = keras_mirror.devices.multi_worker_strategy(spec, cpus)
    workers = spec.num_workers
    rows = (args.warmup + args.steps + 1) * args.batch
    x, y = data(args.model, rows)
    runners = {}
    for v in args.variants:
        if v.startswith("comm_"):
            dtype = None if v == "comm_fp32" else "bfloat16"
            runners[v] = _comm(strategy, args.model, dtype)
            continue
        if v == "native":
            model = _native(strategy, args.model, x, y,
                            args.batch // workers)
        else:
            model = _mirror(args.model, cpus, 0 if v == "mirror" else
                            args.pack, "bfloat16" if v == "mirror_bf16"
                            else None)
        runners[v] = (lambda m: lambda steps, warmup: fit_ms(
            m, x[:(warmup + steps + 1) * args.batch],
            y[:(warmup + steps + 1) * args.batch], args.batch, warmup))(model)
    compute = _local(args, args.batch // workers)
    results = {v: [] for v in args.variants}
    compute_rounds = []
    for r in range(args.repeats):
        order = args.variants[r % len(args.variants):] + \
            args.variants[:r % len(args.variants)]
        for v in order:
            allreduce._OVERLAP = v != "mirror_serial"
            results[v].append(runners[v](args.steps, args.warmup))
            allreduce._OVERLAP = True
            print(f"worker {spec.task_index} round {r} {v} done", flush=True)
        # After a collective step: every worker computes at the same time.
        compute_rounds.append(compute(args.steps, args.warmup))
    with open(f"{args.out}.compute{spec.task_index}.json", "w") as f:
        json.dump(compute_rounds, f)
    timelines = {}
    for v in ("mirror_bucket", "mirror_serial"):
        if v not in runners or not args.trace:
            continue
        allreduce._OVERLAP = v != "mirror_serial"
        steps = 3
        if spec.task_index == 0:
            timelines[v] = _trace(lambda: runners[v](steps, 1),
                                  os.path.join(args.trace, v))
        else:
            runners[v](steps, 1)
        allreduce._OVERLAP = True
    model = build(args.model)
    return {
        "step_ms": results, "workers": workers, "timelines": timelines,
        "params": model.count_params(),
        "bytes_fp32": allreduce.bytes_per_step(model.trainable_variables),
        "bytes_bf16": allreduce.bytes_per_step(model.trainable_variables,
                                               "bfloat16"),
        "write": spec.task_index == 0,
    }


def _local(args, batch):
    """A plain Keras model on this process's first CPU: a function timing
    `steps` of its fit on `batch` rows."""
    import tensorflow as tf

    rows = (args.warmup + args.steps + 1) * batch
    x, y = data(args.model, rows)
    with tf.device("/cpu:0"):
        model = build(args.model)
        model.compile(**compile_args())
    return lambda steps, warmup: fit_ms(
        model, x[:(warmup + steps + 1) * batch],
        y[:(warmup + steps + 1) * batch], batch, warmup)


def single(args):
    run = _local(args, args.batch)
    return {"step_ms": {"single": [run(args.steps, args.warmup)
                                   for _ in range(args.repeats)]},
            "write": True}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("single", "cluster"))
    p.add_argument("out")
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--pack", type=int, default=1 << 20)
    p.add_argument("--variants", default=",".join(CLUSTER_VARIANTS))
    p.add_argument("--trace", default=None,
                   help="directory: profile 3 steps of the bucket variants")
    args = p.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(CLUSTER_VARIANTS)
    if args.role == "cluster" and unknown:
        p.error(f"`--variants` must be among {CLUSTER_VARIANTS}. "
                f"Received: variants={sorted(unknown)!r}")
    out = cluster(args) if args.role == "cluster" else single(args)
    if out.pop("write"):
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
