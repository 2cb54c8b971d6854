"""The cost of global BatchNormalization over an emulated network.

2 workers (`MultiWorkerMirroredStrategy`, 1 logical CPU each), each in its
own network namespace (`netns.py`) with links shaped to each `--rates`
value, train in interleaved rounds three variants of one convnet
(32x32x3, 3 x [Conv - BN - ReLU], global pooling, Dense(10); arrays,
global batch `--batch`):

- `global`: `MirroredModel(model)`, keras-mirror's default
  `batchnorm="global"`: the moments of every plain `BatchNormalization`
  are all-reduced in the forward pass (one device's arithmetic);
- `per_replica`: `MirroredModel(model, batchnorm="per_replica")`: each
  shard's own moments, no collective in the forward pass;
- `no_bn`: the same convnet without its BatchNormalization layers.

It prints the median ms/step (median over rounds of each round's median,
after `--warmup` steps) and the bytes each worker receives and sends per
step (its `eth0` counters, median step, less an idle baseline), the
ratios global / per_replica and global / no_bn, and the extra bytes per
step of the BN moments (global - per_replica). Exactness: before the
timed rounds, each variant's model trains `--exact-steps` steps; its
weights (moving statistics included) are compared with plain Keras on
one device (the same model, data and global batch): max |w - w_ref|
(`no_bn` against the convnet without BN: the reduction-order floor).

Writes `benchmarks/results/bn_network.{json,md}`. Needs root; without
it, says so and exits 0.

Usage:

    python benchmarks/bench_bn_network.py            # ~10 min
    python benchmarks/bench_bn_network.py --quick    # ~1 min
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import net_cluster  # noqa: E402

VARIANTS = ("global", "per_replica", "no_bn")
WORKERS = 2


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="one link (1gbit), 1 round of 2 steps")
    p.add_argument("--rates", default=None,
                   help="tc rates, default 1gbit,100mbit (quick: 1gbit)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--exact-steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rates = (args.rates or ("1gbit" if args.quick
                                 else "1gbit,100mbit")).split(",")
    args.steps = args.steps or (2 if args.quick else 10)
    args.repeats = args.repeats or (1 if args.quick else 5)
    if args.quick:
        args.warmup, args.exact_steps = 1, 2
    args.out = args.out or os.path.join(
        _HERE, "results", "bn_network-quick" if args.quick else "bn_network")
    return args


def build(bn=True):
    """32x32x3 -> 3 x [Conv(32/64/128, 3) (-BN) -ReLU -Pool] -> Dense(10):
    94.5 k parameters (plus 4 x 224 BN variables)."""
    import keras

    keras.utils.set_random_seed(1234)
    L = keras.layers
    layers = [keras.Input((32, 32, 3))]
    for i, filters in enumerate((32, 64, 128)):
        layers.append(L.Conv2D(filters, 3, padding="same"))
        if bn:
            layers.append(L.BatchNormalization())
        layers.append(L.ReLU())
        layers.append(L.MaxPooling2D() if i < 2 else
                      L.GlobalAveragePooling2D())
    return keras.Sequential(layers + [L.Dense(10)])


def data(args):
    """The same arrays in every process (the reference included)."""
    import numpy as np

    rows = max(args.warmup + args.steps + 1, args.exact_steps) * args.batch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, 10, size=(rows,)).astype("int32")


def compile_args():
    import keras

    return dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=False)


def _weights(model):
    return [w.tolist() for w in model.get_weights()]


def _fit(model, x, y, batch, steps, callbacks=()):
    model.fit(x[:steps * batch], y[:steps * batch], batch_size=batch,
              epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))


def cluster(args):
    import keras_mirror

    cpus = keras_mirror.logical_cpus(1)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    def mirrored(variant):
        m = keras_mirror.MirroredModel(
            build(variant != "no_bn"), devices=cpus, timeout_seconds=120,
            batchnorm="per_replica" if variant == "per_replica"
            else "global")
        m.compile(**compile_args())
        return m

    models = {v: mirrored(v) for v in VARIANTS}
    n = args.warmup + args.steps + 1
    x, y = data(args)
    exact = {}
    for v in VARIANTS:  # from the same initial weights as the reference
        _fit(models[v], x, y, args.batch, args.exact_steps)
        exact[v] = _weights(models[v].model)
    rounds = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            meter = net_cluster.Meter()
            _fit(models[v], x, y, args.batch, n, [meter])
            rounds[v].append(net_cluster.per_step(meter.readings,
                                                  skip=args.warmup))
    return {"worker": index, "rounds": rounds, "exact": exact,
            "idle_bytes_per_s": net_cluster.idle(2.0),
            "params": build().count_params()}


def single(args):
    import tensorflow as tf

    x, y = data(args)
    out = {}
    for bn in (True, False):
        with tf.device("/cpu:0"):
            model = build(bn)
            model.compile(**compile_args())
            _fit(model, x, y, args.batch, args.exact_steps)
        out["bn" if bn else "no_bn"] = _weights(model)
    return out


def _gaps(a, b):
    """max |u - v| of each weight array."""
    import numpy as np

    return [float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
            for u, v in zip(a, b)]


def summarise(args, results, reference):
    rows = []
    for rate, workers in results.items():
        row = {"rate": rate}
        for v in VARIANTS:
            med = lambda k: statistics.median(  # noqa: E731
                statistics.median(s[k] for s in rnd)
                for w in workers for rnd in w["rounds"][v] if rnd)
            row[f"{v}_ms"] = statistics.median(
                statistics.median(s[0] for s in rnd)
                for rnd in workers[0]["rounds"][v] if rnd)
            idle = statistics.mean(w["idle_bytes_per_s"][0] for w in workers)
            row[f"{v}_rx"] = med(1) - idle * row[f"{v}_ms"] / 1000
            row[f"{v}_tx"] = med(2) - idle * row[f"{v}_ms"] / 1000
        row["global/per_replica"] = row["global_ms"] / row["per_replica_ms"]
        row["global/no_bn"] = row["global_ms"] / row["no_bn_ms"]
        row["per_replica/no_bn"] = row["per_replica_ms"] / row["no_bn_ms"]
        row["bn_extra_rx"] = row["global_rx"] - row["per_replica_rx"]
        row["bn_extra_tx"] = row["global_tx"] - row["per_replica_tx"]
        for v in VARIANTS:
            ref = reference["no_bn" if v == "no_bn" else "bn"]
            gaps = [max(g) for g in zip(*(
                _gaps(w["exact"][v], ref) for w in workers))]
            row[f"exact_{v}"] = max(gaps)
            row[f"exact_{v}_per_weight"] = gaps
        rows.append(row)
    return rows


def markdown(report):
    s, m = report["settings"], report["machine"]
    lines = [
        "# bench_bn_network: global BatchNorm over an emulated network", "",
        f"- Date: {report['date']}; command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['logical_cores']} logical cores; "
        f"TensorFlow {m['tensorflow']}, Keras {m['keras']}, keras-mirror "
        f"{m['git_commit']}; load average before/after "
        f"{report['loadavg_before']} / {report['loadavg_after']}",
        f"- {WORKERS} workers x 1 CPU replica in network namespaces, veth "
        "links to a bridge shaped by `tc tbf`; convnet 32x32x3, 3 x "
        f"[Conv-BN-ReLU] ({report['params']} parameters), global batch "
        f"{s['batch']}; {s['repeats']} interleaved round(s) of "
        f"{s['steps']} steps after {s['warmup']} warm-up step(s); ms/step: "
        "worker 0's median over rounds of each round's median; bytes: "
        "worker's `eth0` (link layer, framing included) per step, median, "
        "less the idle baseline.", "",
        "| link | global ms | per_replica ms | no BN ms | global / "
        "per_replica | global / no BN | per_replica / no BN | rx KB/step "
        "global | per_replica | no BN | BN moments extra rx / tx KB/step | "
        "max abs(w - w_ref) global | per_replica | no BN |",
        "|---|" + "---:|" * 13]
    for r in report["rows"]:
        lines.append(
            f"| {r['rate']} | {r['global_ms']:.1f} | "
            f"{r['per_replica_ms']:.1f} | {r['no_bn_ms']:.1f} | "
            f"{r['global/per_replica']:.2f} | {r['global/no_bn']:.2f} | "
            f"{r['per_replica/no_bn']:.2f} | {r['global_rx'] / 1e3:.1f} | "
            f"{r['per_replica_rx'] / 1e3:.1f} | {r['no_bn_rx'] / 1e3:.1f} | "
            f"{r['bn_extra_rx'] / 1e3:.1f} / {r['bn_extra_tx'] / 1e3:.1f} | "
            f"{r['exact_global']:.1e} | {r['exact_per_replica']:.1e} | "
            f"{r['exact_no_bn']:.1e} |")
    lines += ["", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


NOTES = [
    "w_ref: plain Keras on one CPU device, the same model, data and global "
    "batch, trained the same steps; w: each worker's weights after its "
    "MirroredModel trained them, before the timed rounds (BN moving "
    "statistics included); "
    "no BN against plain Keras's no-BN convnet: the float32 reduction-order "
    "floor of 2 replicas against one device.",
    "BN moments: per layer of C channels, 3 all-reduces of C floats in the "
    "forward pass (row count, sum, squared deviations) and the gradients "
    "of two of them in the backward pass; 224 channels here, so about "
    "4.5 KB of payload per step before framing.",
]


def _role_main(args):
    out = cluster(args) if args.role == "cluster" else single(args)
    name = args.result if args.role == "single" else \
        f"{args.result}.{out['worker']}"
    with open(name, "w") as f:
        json.dump(out, f)
    return 0


def _clusters(args, net, env, common, tmp, log, results):
    """One cluster per link rate; `results[rate]` = each worker's output."""
    for k, rate in enumerate(args.rates):
        net.set_rate(rate)
        print(f"{WORKERS} workers over {rate} ...", flush=True)
        out = os.path.join(tmp, f"cluster{k}.json")
        argv_ = [sys.executable, os.path.abspath(__file__), "--role",
                 "cluster", "--result", out, *common]
        try:
            net_cluster.run(net, lambda i: argv_, env, 24500 + k,
                            args.timeout, log)
        except RuntimeError as e:
            print(net_cluster.log_tail(log), file=sys.stderr)
            raise SystemExit(f"cluster over {rate} failed: {e}")
        results[rate] = [json.load(open(f"{out}.{i}"))
                         for i in range(WORKERS)]


def main(argv=None):
    args = parse(argv)
    if args.role:
        return _role_main(args)
    import netns

    reason = netns.unavailable()
    if reason:
        print(f"bench_bn_network: skipped: {reason}. It runs workers in "
              "network namespaces and needs root.")
        return 0
    import subprocess

    import bench_report

    start, load_before = time.monotonic(), bench_report.loadavg()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    common = ["--batch", str(args.batch), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--repeats", str(args.repeats),
              "--exact-steps", str(args.exact_steps)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp, \
            open(os.path.join(tmp, "workers.log"), "w") as log:
        ref = os.path.join(tmp, "single.json")
        # The reference trains beside the first cluster (its weights do
        # not depend on time); quick mode only: the full run's timings
        # must not share the cores with it.
        single = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", "single",
             "--result", ref, *common], env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if not args.quick:
                single.wait(timeout=args.timeout)
            with netns.Network(WORKERS) as net:
                _clusters(args, net, env, common, tmp, log, results)
            if single.wait(timeout=args.timeout):
                raise SystemExit("the one-device reference failed:\n"
                                 + net_cluster.log_tail(log))
        finally:
            if single.poll() is None:
                os.killpg(single.pid, signal.SIGKILL)
                single.wait()
        reference = json.load(open(ref))
    import keras
    import tensorflow as tf

    report = {
        "benchmark": "bench_bn_network",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "command": "python benchmarks/bench_bn_network.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bench_report.describe_machine(tf, keras, []),
        "settings": {k: getattr(args, k) for k in (
            "quick", "rates", "batch", "steps", "warmup", "repeats",
            "exact_steps")},
        "loadavg_before": load_before, "loadavg_after": bench_report.loadavg(),
        "seconds": round(time.monotonic() - start, 1),
        "params": results[args.rates[0]][0]["params"],
        "rows": summarise(args, results, reference), "notes": NOTES,
        "raw": {rate: [{k: v for k, v in w.items() if k != "exact"}
                       for w in ws] for rate, ws in results.items()},
    }
    bench_report.write(report, args.out, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
