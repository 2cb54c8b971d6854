"""Data-parallel training over an emulated network: all-reduce, bf16, overlap.

Runs W `MultiWorkerMirroredStrategy` workers, each in its own network
namespace with its own address, joined through a bridge by veth links
shaped with `tc tbf` to each `--rates` value (`benchmarks/netns.py`),
and prints, per model and link, ms/step side by side for: one device
(global batch); the compute alone (each worker's plain single-device fit
of its B/W rows, all at once, no network); the gradient all-reduce alone
in fp32 and bf16; native Keras `fit` under the strategy; `MirroredModel`
fp32 (one all-reduce); fp32 in `--pack`-byte buckets, last layers first
(overlap with backprop); the same buckets made to wait for every
gradient (no overlap); bf16 buckets; and the ring model's time
`2(W-1)/W * bytes / rate`. Writes JSON and Markdown under `benchmarks/results/`
(machine, load, every step time) and ends with the line

    comm_bf16/comm_fp32=<r> overlap_step/max(compute,comm)=<r> mirror/native=<r>

for the model and link whose communication and compute are closest (the
"same order" case of issue 15): the measured all-reduce time in bf16 over
fp32; `MirroredModel` with buckets over max(compute, fp32 all-reduce);
`MirroredModel` fp32 over native Keras.

Needs root (network namespaces); without it, says so and exits 0.

Usage:

    sudo python benchmarks/bench_network.py --quick   # ~5 min
    sudo python benchmarks/bench_network.py           # ~15 min
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_report  # noqa: E402
import net_worker  # noqa: E402
import netns  # noqa: E402

WORKER = os.path.join(_HERE, "net_worker.py")
BATCH = {"mlp": 512, "convnet": 256}
LABELS = {
    "single": "one device", "compute": "compute (no network)",
    "ring_model": "ring model", "comm_fp32": "all-reduce fp32",
    "comm_bf16": "all-reduce bf16", "native": "native Keras",
    "mirror": "MirroredModel fp32", "mirror_bucket": "buckets fp32",
    "mirror_serial": "buckets fp32, no overlap",
    "mirror_bf16": "buckets bf16",
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="one link (300mbit), 1 repeat of 3 steps")
    p.add_argument("--models", default="mlp,convnet")
    p.add_argument("--rates", default=None,
                   help="tc rates, default 1gbit,300mbit,100mbit "
                   "(quick: 300mbit)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--pack", type=int, default=1 << 20,
                   help="bytes_per_pack of the bucketed variants")
    p.add_argument("--variants", default=",".join(
        net_worker.CLUSTER_VARIANTS))
    p.add_argument("--timeout", type=float, default=420,
                   help="seconds before a phase's processes are SIGKILLed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.rates = (args.rates or ("300mbit" if args.quick else
                                 "1gbit,300mbit,100mbit")).split(",")
    args.steps = args.steps or (3 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.out = args.out or os.path.join(
        _HERE, "results", "network-quick" if args.quick else "network")
    return args


def _run_phase(commands, out_file, timeout, log):
    """Starts `commands` (lists), waits; SIGKILLs all on timeout/error."""
    procs = []
    try:
        for cmd, env in commands:
            procs.append(subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"worker exit codes {codes}")
        with open(out_file) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _worker_args(args, model, out_file, role):
    return [sys.executable, WORKER, role, out_file, "--model", model,
            "--batch", str(BATCH[model]), "--workers", str(args.workers),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--repeats", str(args.repeats), "--pack", str(args.pack),
            "--variants", args.variants]


def measure(args, net, tmp, log):
    """{model: {"single", rate: cluster output with "compute"}}."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    results, port = {}, 23456
    for model in args.models:
        res = results[model] = {}
        out = os.path.join(tmp, "out.json")
        print(f"{model}: one device ...", flush=True)
        res["single"] = _run_phase(
            [(_worker_args(args, model, out, "single"), env)], out,
            args.timeout, log)["step_ms"]["single"]
        for rate in args.rates:
            net.set_rate(rate)
            port += 1
            hosts = [f"{a}:{port}" for a in net.addresses]
            print(f"{model}: {args.workers} workers over {rate} ...",
                  flush=True)
            cmds = []
            for i in range(args.workers):
                tf_config = {"cluster": {"worker": hosts},
                             "task": {"type": "worker", "index": i}}
                cmds.append((net.command(i, _worker_args(
                    args, model, out, "cluster") + [
                        "--trace", os.path.join(tmp, f"trace_{port}")]),
                    dict(env, TF_CONFIG=json.dumps(tf_config))))
            try:
                res[rate] = _run_phase(cmds, out, args.timeout, log)
                res[rate]["compute"] = []
                for i in range(args.workers):
                    with open(f"{out}.compute{i}.json") as f:
                        res[rate]["compute"] += json.load(f)
            except (RuntimeError, OSError, ValueError,
                    subprocess.TimeoutExpired) as e:
                # Recorded, not raised: the other links still run.
                res[rate] = {"error": f"{type(e).__name__}: {e}"}
                log.flush()
                with open(log.name) as f:
                    tail = f.read()[-3000:]
                print(f"{model} over {rate} failed: {e}\n{tail}", flush=True)
    return results


def _median(rounds):
    """Median over rounds of each round's median step time."""
    return statistics.median(statistics.median(r) for r in rounds if r)


def summarise(args, results):
    rows = []
    w = args.workers
    for model, res in results.items():
        for rate in args.rates:
            cl = res[rate]
            if "error" in cl:
                continue
            row = {"model": model, "rate": rate, "workers": w,
                   "batch": BATCH[model], "params": cl["params"],
                   "bytes_fp32": cl["bytes_fp32"],
                   "single": _median(res["single"]),
                   "compute": _median(cl["compute"]),
                   "ring_model": 1000 * 2 * (w - 1) / w * cl["bytes_fp32"]
                   / netns.bytes_per_second(rate)}
            for v, rounds in cl["step_ms"].items():
                row[v] = _median(rounds)
            for v, steps in cl.get("timelines", {}).items():
                steps = steps[1:] or steps  # the first holds the profiler
                row[f"{v}_timeline"] = {
                    k: statistics.median(t[k] for t in steps)
                    for k in steps[0]} if steps else None
            _ratios(row)
            t = row.get("mirror_bucket_timeline")
            if t and "comm_fp32" in row:
                # Nothing overlaps the forward pass and the first bucket's
                # backprop: the best an overlapped step can do.
                row["overlap_bound"] = (
                    t["first_allreduce_start_ms"] + row["comm_fp32"]) / max(
                        row["compute"], row["comm_fp32"])
            rows.append(row)
    return rows


def _ratios(row):
    def div(a, b):
        return row[a] / row[b] if a in row and b in row else None

    comm = max(row["compute"], row.get("comm_fp32", 0))
    row["comm_over_compute"] = div("comm_fp32", "compute")
    row["comm_bf16/comm_fp32"] = div("comm_bf16", "comm_fp32")
    row["overlap_step/max(compute,comm)"] = (
        row["mirror_bucket"] / comm if "mirror_bucket" in row else None)
    row["serial_step/(compute+comm)"] = (
        row["mirror_serial"] / (row["compute"] + row["comm_fp32"])
        if "mirror_serial" in row and "comm_fp32" in row else None)
    row["mirror/native"] = div("mirror", "native")
    row["buckets/native"] = div("mirror_bucket", "native")


def headline(rows):
    """The row whose communication and compute are closest."""
    import math

    usable = [r for r in rows if r.get("comm_over_compute")]
    return min(usable, key=lambda r: abs(math.log(r["comm_over_compute"])))


def _f(v, spec=".1f"):
    return "nan" if v is None else format(v, spec)


def markdown(report):
    rows, head = report["rows"], report["headline"]
    m, s = report["machine"], report["settings"]
    cols = [c for c in LABELS if any(c in r for r in rows)]
    lines = [
        "# bench_network results", "",
        f"- Date: {report['date']}; command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['physical_cores']} physical / "
        f"{m['logical_cores']} logical cores, {m['memory_gb']} GB; "
        f"TensorFlow {m['tensorflow']}, Keras {m['keras']}, keras-mirror "
        f"{m['keras_mirror']} ({m['git_commit']})",
        f"- Load average before/after: {report['loadavg_before']} / "
        f"{report['loadavg_after']}",
        f"- {s['workers']} workers x 1 CPU replica, each in its own network "
        "namespace (10.77.0.x), veth links to a bridge, `tc tbf` at the "
        "link rate in both directions; gRPC ring all-reduce "
        f"(`CollectiveCommunication.AUTO`); buckets of {s['pack']} bytes; "
        f"{s['repeats']} interleaved round(s) of {s['steps']} timed steps "
        "(after a warm-up step); medians of the rounds' medians, ms/step.",
        "",
        "| model | link | " + " | ".join(LABELS[c] for c in cols)
        + " | overlap / max(compute, comm) | its bound | no-overlap / "
        "(compute + comm) | bf16 / fp32 comm | MirroredModel / native |",
        "|---|---|" + "---:|" * (len(cols) + 5),
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['bytes_fp32'] / 1e6:.1f} MB, batch "
            f"{r['batch']}) | {r['rate']} | "
            + " | ".join(_f(r.get(c)) for c in cols) + " | "
            + " | ".join(_f(r.get(k), ".2f") for k in (
                "overlap_step/max(compute,comm)", "overlap_bound",
                "serial_step/(compute+comm)", "comm_bf16/comm_fp32",
                "mirror/native")) + " |")
    lines += ["", "Timeline of a step (TensorFlow profiler on worker 0, "
              "3 steps, medians; ms from the start of the step):", "",
              "| model | link | variant | backprop ends | first gradient "
              "all-reduce starts | last ends | all-reduce during backprop "
              "| step |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for v in ("mirror_bucket", "mirror_serial"):
            t = r.get(f"{v}_timeline")
            if t:
                lines.append(
                    f"| {r['model']} | {r['rate']} | {LABELS[v]} | "
                    f"{t['backprop_end_ms']:.1f} | "
                    f"{t['first_allreduce_start_ms']:.1f} | "
                    f"{t['last_allreduce_end_ms']:.1f} | "
                    f"{t['overlap_ms']:.1f} | {t['step_ms']:.1f} |")
    lines += ["", f"Headline ({head['model']} over {head['rate']}, "
              f"communication / compute = {head['comm_over_compute']:.2f}): "
              f"`{report['ratio_line']}`", ""]
    lines += [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


NOTES = [
    "one device: plain Keras fit of the global batch on one CPU device, "
    "alone on the machine; compute: each worker's plain single-device fit "
    "of its B/W rows, all W at once after a collective step (the step's "
    "compute under the same CPU sharing, no network).",
    "all-reduce fp32/bf16: only the gradient all-reduce of tensors of the "
    "gradients' shapes, one bucket, timed per call (no compute running).",
    "ring model: 2(W-1)/W x gradient bytes / link rate; gRPC and TCP "
    "framing and the CPU cost of the transfer come on top.",
    "buckets fp32: bytes_per_pack buckets filled from the last variable "
    "backwards and issued in that order, so each starts when its gradients "
    "exist; 'no overlap' is the same graph with every bucket made to wait "
    "for all gradients (`allreduce._OVERLAP = False`).",
    "its bound: (when the first gradient all-reduce starts, from the "
    "timeline + all-reduce fp32) / max(compute, comm): the forward pass "
    "and the first bucket's backprop run before any all-reduce can start, "
    "so no overlap does better.",
    "The forward pass and the optimizer update cannot overlap with the "
    "same step's all-reduce, so an overlapped step is at least forward + "
    "communication + update: about 1.3 x max(compute, comm) when they are "
    "equal. On 2 shared cores, gRPC's own CPU time (about 15-20 ms per "
    "7 MB all-reduce per worker, measured) competes with the other "
    "worker's compute.",
]


def main(argv=None):
    args = parse(argv)
    reason = netns.unavailable()
    if reason:
        print(f"bench_network: skipped: {reason}. It runs workers in "
              "network namespaces and needs root.")
        return 0
    start = time.monotonic()
    load_before = bench_report.loadavg()
    with tempfile.TemporaryDirectory() as tmp, \
            open(os.path.join(tmp, "workers.log"), "w") as log:
        try:
            with netns.Network(args.workers) as net:
                results = measure(args, net, tmp, log)
        except Exception:
            log.flush()
            print(open(log.name).read()[-4000:], file=sys.stderr)
            raise
    rows = summarise(args, results)
    failed = [f"{m} over {r}: {res[r]['error']}" for m, res in
              results.items() for r in args.rates if "error" in res[r]]
    if not rows:
        print("bench_network: every cluster run failed:\n"
              + "\n".join(failed), file=sys.stderr)
        return 1
    head = headline(rows)
    line = " ".join(f"{k}={_f(head.get(k), '.3f')}" for k in (
        "comm_bf16/comm_fp32", "overlap_step/max(compute,comm)",
        "mirror/native"))
    import keras
    import tensorflow as tf

    report = {
        "benchmark": "bench_network",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "command": "python benchmarks/bench_network.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bench_report.describe_machine(tf, keras, []),
        "settings": {k: getattr(args, k) for k in (
            "quick", "models", "rates", "workers", "steps", "warmup",
            "repeats", "pack", "variants")} | {"batch": BATCH},
        "loadavg_before": load_before,
        "loadavg_after": bench_report.loadavg(),
        "seconds": round(time.monotonic() - start, 1),
        "rows": rows, "headline": head, "ratio_line": line,
        "notes": NOTES + [f"FAILED: {f}" for f in failed],
        "raw": results,
    }
    bench_report.write(report, args.out, markdown(report))
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
