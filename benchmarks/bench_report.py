"""Machine description, summary and reports of `bench_step.py`.

Kept apart from `bench_step.py`, which plans and runs the trials, so that
each file stays small. It never imports TensorFlow itself.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_RESULTS = os.path.join(_HERE, "results")
_MODELS = ("mlp", "convnet", "convnet_bn", "gan")  # display order


def describe_machine(tf, keras, gpus):
    """The machine and software versions, as a JSON-ready dict."""
    import numpy
    import psutil

    gpu_names = []
    for gpu in gpus:
        try:
            details = tf.config.experimental.get_device_details(gpu)
            gpu_names.append(details.get("device_name", gpu.name))
        except Exception:
            gpu_names.append(gpu.name)
    freq = psutil.cpu_freq()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "cpu_mhz": round(freq.current) if freq else None,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpu_names,
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": numpy.__version__,
        "keras_mirror": keras_mirror_version(),
        "git_commit": git_commit(),
    }


def keras_mirror_version():
    """Reads `version.py` as text: works while the package is mid-edit."""
    namespace = {}
    try:
        with open(os.path.join(_ROOT, "keras_mirror", "version.py")) as f:
            exec(f.read(), namespace)
    except Exception:
        return None
    return namespace.get("__version__")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root=_ROOT):
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=root,
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

def key(cfg):
    """The name of a trial configuration, e.g. `mlp/native/N=2`."""
    return f"{cfg['model']}/{cfg['variant']}/N={cfg['replicas']}"


def summarise(configs, trials):
    rows = []
    for cfg in configs:
        runs = trials[key(cfg)]
        ok = [t for t in runs if t["ok"]]
        row = {k: cfg[k] for k in ("model", "variant", "replicas")}
        row.update(trials_ok=len(ok), trials_failed=len(runs) - len(ok))
        if ok and ok[0].get("execution"):
            row["execution"] = ok[0]["execution"]
        if ok:
            medians = [t["median_step_ms"] for t in ok]
            row.update(
                median_step_ms=statistics.median(medians),
                min_trial_step_ms=min(medians),
                max_trial_step_ms=max(medians),
                first_step_s=statistics.median(t["first_step_s"] for t in ok),
                setup_s=statistics.median(t["setup_s"] for t in ok),
                peak_rss_mb=statistics.median(t["peak_rss_mb"] for t in ok),
                rss_after_import_mb=statistics.median(
                    t["rss_after_import_mb"] for t in ok
                ),
                params=ok[0]["params"],
                cpu_ms_per_step=statistics.median(
                    t.get("cpu_ms_per_step", 0.0) for t in ok),
            )
        else:
            row["error"] = runs[-1]["error"] if runs else "not run"
        rows.append(row)
    return rows


def ratios(rows):
    """MirroredModel / native and / single-device, and native / single."""
    ms = {
        (r["model"], r["variant"], r["replicas"]): r.get("median_step_ms")
        for r in rows
    }
    cpu = {
        (r["model"], r["variant"], r["replicas"]): r.get("cpu_ms_per_step")
        for r in rows
    }
    pairs = sorted(
        {(r["model"], r["replicas"]) for r in rows if r["variant"] != "single"},
        key=lambda p: (_order(p[0]), p[1]),
    )
    out = []
    for m, n in pairs:
        mirrored = ms.get((m, "mirrored", n))
        strategy = ms.get((m, "mirrored_strategy", n))
        native = ms.get((m, "native", n))
        single = ms.get((m, "single", 1))
        baseline = ms.get((m, "mirrored_baseline", n))
        out.append({
            "model": m,
            "replicas": n,
            "mirrored_over_native": _div(mirrored, native),
            "mirrored_over_single": _div(mirrored, single),
            "strategy_over_native": _div(strategy, native),
            "strategy_over_single": _div(strategy, single),
            "native_over_single": _div(native, single),
            "baseline_over_single": _div(baseline, single),
            "mirrored_over_baseline": _div(mirrored, baseline),
            "cpu_mirrored_over_single": _div(cpu.get((m, "mirrored", n)),
                                             cpu.get((m, "single", 1))),
            "cpu_baseline_over_single": _div(
                cpu.get((m, "mirrored_baseline", n)),
                cpu.get((m, "single", 1))),
        })
    return out


def _order(model):
    return _MODELS.index(model) if model in _MODELS else len(_MODELS)


def _div(a, b):
    return a / b if a and b else None


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown(report):
    """Renders the report as Markdown: set-up, results, ratios, notes."""
    lines = _md_header(report) + _md_results(report) + _md_ratios(report)
    if report["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _md_header(report):
    m, s = report["machine"], report["settings"]
    cpus = (f" ({s['num_cpus']} logical CPUs per process)"
            if any("cpu" in d.lower() for d in s["devices"]) else "")
    return [
        "# bench_step results",
        "",
        f"- Date: {report['date']}",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['physical_cores']} physical / "
        f"{m['logical_cores']} logical cores, {m['memory_gb']} GB; "
        f"GPUs: {', '.join(m['gpus']) or 'none'}; {m['platform']}",
        f"- Versions: Python {m['python']}, TensorFlow {m['tensorflow']}, "
        f"Keras {m['keras']}, NumPy {m['numpy']}, keras-mirror "
        f"{m['keras_mirror']} ({m['git_commit']})",
        f"- Devices: {', '.join(s['devices'])}{cpus}; native all-reduce: "
        f"{s['native_all_reduce']}",
        f"- Global batch {s['batch_size']}, {s['steps']} timed steps after "
        f"{s['warmup']} warm-up step(s), {s['repeats']} interleaved "
        f"trial(s) per config, one fresh process per trial; "
        f"load average before/after: {report['loadavg_before']} / "
        f"{report['loadavg_after']}",
    ] + ([f"- Baseline (`mirrored_baseline`, before): "
          f"`{s['baseline']}` at {s.get('baseline_commit')}"]
         if s.get("baseline") else [])


def _md_results(report):
    lines = [
        "",
        "| model | variant | N | ms/step (median) | trial range | "
        "CPU ms/step | first step s | setup s | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        variant = r["variant"]
        if r.get("execution") and variant in ("mirrored",
                                              "mirrored_baseline"):
            variant = f"{variant} ({r['execution']})"
        head = f"| {r['model']} | {variant} | {r['replicas']} |"
        if "median_step_ms" not in r:
            lines.append(f"{head} failed: {r['error'][:60]} | | | | | |")
            continue
        lines.append(
            f"{head} {r['median_step_ms']:.2f} | "
            f"{r['min_trial_step_ms']:.2f}-{r['max_trial_step_ms']:.2f} | "
            f"{_fmt(r.get('cpu_ms_per_step'), '.2f')} | "
            f"{r['first_step_s']:.2f} | {r['setup_s']:.2f} | "
            f"{r['peak_rss_mb']:.0f} |"
        )
    return lines


def _md_ratios(report):
    baseline = any(q.get("baseline_over_single") for q in report["ratios"])
    extra = (" before (baseline) / single | after / before | CPU time: "
             "MirroredModel / single | CPU time: before / single |"
             if baseline else "")
    lines = [
        "",
        "| model | N | MirroredModel / native | MirroredModel / single | "
        "strategy path / native | strategy path / single | "
        "native / single |" + extra,
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" * 4 if baseline
                                                 else ""),
    ]
    for q in report["ratios"]:
        cells = [q["mirrored_over_native"], q["mirrored_over_single"],
                 q.get("strategy_over_native"), q.get("strategy_over_single"),
                 q["native_over_single"]]
        if baseline:
            cells += [q.get("baseline_over_single"),
                      q.get("mirrored_over_baseline"),
                      q.get("cpu_mirrored_over_single"),
                      q.get("cpu_baseline_over_single")]
        lines.append(f"| {q['model']} | {q['replicas']} | " + " | ".join(
            _fmt(c, ".2f") for c in cells) + " |")
    if not report["ratios"]:
        lines.append("| - | - | - | - | - | - | - |")
    return lines


def default_out():
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    host = platform.node().split(".")[0] or "host"
    return os.path.join(_RESULTS, f"bench_step-{host}-{stamp}")


def write(report, out, text=None):
    """Prints the Markdown report and writes `out`.json and `out`.md.

    `text` is the Markdown; by default, `bench_step`'s table of `report`.
    """
    if text is None:
        text = markdown(report)
    print()
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(f"Wrote {out}.json and {out}.md")


def loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None
