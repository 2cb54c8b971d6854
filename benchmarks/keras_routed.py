"""Keras's own tests, plain and routed through `MirroredModel`.

Runs selected test files of the installed Keras twice, each file in its
own pytest process: plain, and with every `keras.Model`'s `fit`,
`evaluate`, `predict`, `train_on_batch`, `test_on_batch` and
`predict_on_batch` routed through `keras_mirror.MirroredModel(model)` on
2 logical CPUs. Then prints, per file, the tests passed plain, passed
routed, and each test that passes plain but fails routed, with the first
line of its routed error (`--out` writes the same as `.md` and `.json`).

Usage (from the repository root, with the project's virtualenv):

    python benchmarks/keras_routed.py trainers/trainer_test.py \\
        'callbacks/*_test.py' --timeout 300 --out benchmarks/results/x

File arguments are paths or globs relative to Keras's `keras/src`.

The same module is the pytest plugin each run loads (`-p keras_routed`):
at import it splits the CPU into 2 logical devices (before TensorFlow
initialises), and with `KERAS_ROUTED=1` it replaces the six methods on
`keras.Model`. A routed call makes (once per model object) and reuses a
`MirroredModel(model)`, and calls its method. Calls are not routed, so as
not to recurse, when the model is a `MirroredModel` (its `super().fit`
lands here), or when the caller is keras-mirror's own code or Keras's
library code (not its tests or `keras.src.testing`, whose
`run_layer_test` fits the layer tests' models). Objects that are Keras
`Trainer`s but not `keras.Model`s (most of `trainer_test.py`'s models:
`class ExampleModel(Trainer, layers.Dense)`) are not routed: the wrapper
takes a `keras.Model`. The "tests routed" column counts the tests that made at
least one routed call.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
METHODS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
           "predict_on_batch")

# -- the plugin --------------------------------------------------------------

_calls = {"routed": 0}
_out = None


def _routable(module):
    """Whether a call made from `module` (a module name) is routed."""
    if module.startswith("keras_mirror"):
        return False
    if module.startswith("keras."):
        return module.endswith("_test") or module.startswith(
            "keras.src.testing")
    return True


def _install():
    import functools

    import keras

    from keras_mirror import MirroredModel
    from keras_mirror.wrapper import _model_methods

    def wrapper_of(model):
        # A dunder name: Keras's saving walks every other attribute, and
        # would walk the wrapper and, through it, the model again.
        mirrored = model.__dict__.get("__keras_routed_wrapper")
        if mirrored is None:
            mirrored = MirroredModel(model)
            object.__setattr__(model, "__keras_routed_wrapper", mirrored)
        return mirrored

    def route(name):
        original = getattr(keras.Model, name)
        # Inside a model class's own override (its `super().fit(...)`), the
        # wrapper's method runs without `through_model`, which would call
        # the override a second time.
        raw = getattr(MirroredModel, name).__wrapped__.__wrapped__

        @functools.wraps(original)
        def routed(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if getattr(type(self), "_keras_mirror_wrapper", False) or (
                    not _routable(caller)):
                return original(self, *args, **kwargs)
            _calls["routed"] += 1
            mirrored = wrapper_of(self)
            if _model_methods.overrides(self, name):
                return raw(mirrored, *args, **kwargs)
            return getattr(mirrored, name)(*args, **kwargs)

        setattr(keras.Model, name, routed)

    for name in METHODS:
        route(name)


def pytest_collection(session):
    """`trainer_test.py` imports `jax` at the top but uses it only under
    the JAX backend: without JAX installed, a stand-in module lets it
    import, only while the tests are collected (Keras and TensorFlow, once
    imported, probe `jax` in `sys.modules`)."""
    import importlib.util
    import types

    if importlib.util.find_spec("jax") is None:
        sys.modules["jax"] = types.ModuleType("jax")
        sys.modules["jax"].keras_routed_stub = True


def _stub_conftest():
    """Some test files import `skip_if_backend` from the `conftest.py` at
    the root of Keras's repository, which the wheel does not ship."""
    import types

    import pytest

    def skip_if_backend(given_backend, reason):
        import keras

        return pytest.mark.skipif(keras.backend.backend() == given_backend,
                                  reason=reason)

    module = types.ModuleType("conftest")
    module.skip_if_backend = skip_if_backend
    sys.modules.setdefault("conftest", module)


def pytest_collection_finish(session):
    if getattr(sys.modules.get("jax"), "keras_routed_stub", False):
        del sys.modules["jax"]


def _plugin_setup():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import keras_mirror

    keras_mirror.logical_cpus(2)  # before TensorFlow initialises devices
    _stub_conftest()
    if os.environ.get("KERAS_ROUTED") == "1":
        _install()


if os.environ.get("KERAS_ROUTED_PLUGIN") == "1":
    _plugin_setup()
    _out = os.environ.get("KERAS_ROUTED_OUT")


def pytest_runtest_setup(item):
    _calls["routed"] = 0


def pytest_collectreport(report):
    """A file that fails to import shows as one failed "test"."""
    if report.failed:
        _record(report, "collect")


def pytest_runtest_logreport(report):
    _record(report)


def _record(report, when=None):
    """Appends a test's outcome (one JSON line) as soon as it is known."""
    if _out is None:
        return
    failed = report.failed
    if when == "collect":
        outcome = "failed"
    elif report.when == "call" or (report.when == "setup" and not
                                 report.passed):
        outcome = "failed" if failed else report.outcome
    elif report.when == "teardown" and failed:
        outcome = "failed"
    else:
        return
    error = ""
    if failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(report.longrepr)
        error = (text.strip().splitlines() or [""])[0][:300]
    with open(_out, "a") as f:
        f.write(json.dumps({"test": report.nodeid,
                            "when": when or report.when,
                            "outcome": outcome, "error": error,
                            "routed": _calls["routed"]}) + "\n")


# -- the runner --------------------------------------------------------------


def _keras_src():
    import importlib.util

    spec = importlib.util.find_spec("keras")
    return os.path.join(os.path.dirname(spec.origin), "src")


def _run_file(path, routed, timeout, file_timeout, workdir):
    """Runs one test file in its own pytest process: {test: record}."""
    out = os.path.join(workdir, f"{os.getpid()}-{time.time_ns()}.jsonl")
    ini = os.path.join(workdir, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\naddopts =\nfilterwarnings =\n"
                "    ignore::DeprecationWarning\n")
    env = dict(os.environ, KERAS_ROUTED_PLUGIN="1", KERAS_ROUTED_OUT=out,
               KERAS_ROUTED="1" if routed else "0",
               PYTHONPATH=os.pathsep.join(
                   [_HERE, _ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-c", ini, "-p", "keras_routed",
           "-p", "no:cacheprovider", "-q", "-n0", f"--timeout={timeout}",
           path]
    started = time.time()
    note = ""
    try:
        subprocess.run(cmd, env=env, cwd=workdir, timeout=file_timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        note = f"file timeout after {file_timeout} s"
    results = {}
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                record = json.loads(line)
                test = record.pop("test")
                if test not in results or record["outcome"] == "failed":
                    results[test] = record
    return results, round(time.time() - started, 1), note


def _short(test):
    return test.split("::", 1)[-1]


def _compare(name, plain, routed):
    passed = {t for t, r in plain.items() if r["outcome"] == "passed"}
    passed_routed = {t for t, r in routed.items() if r["outcome"] == "passed"}
    differences = [
        {"test": _short(t), "error": routed.get(t, {}).get(
            "error", "not run (the routed process ended first)")}
        for t in sorted(passed - passed_routed)]
    return {"file": name, "tests": len(plain), "passed_plain": len(passed),
            "passed_routed": len(passed & passed_routed),
            "routed_tests": sum(1 for r in routed.values() if r["routed"]),
            "newly_passing": sorted(
                _short(t) for t in passed_routed - passed),
            "differences": differences}


def _table(rows):
    lines = ["| file | tests | passed plain | passed routed | tests "
             "routed | differences |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['file']} | {row['tests']} | {row['passed_plain']} | "
            f"{row['passed_routed']} | {row['routed_tests']} | "
            f"{len(row['differences'])} |")
    lines += ["", "| group | files | passed plain | passed routed | tests "
              "routed | differences |", "|---|---:|---:|---:|---:|---:|"]
    groups = {}
    for row in rows:
        group = groups.setdefault(row["file"].split("/")[0], [0] * 5)
        for i, value in enumerate((1, row["passed_plain"],
                                   row["passed_routed"], row["routed_tests"],
                                   len(row["differences"]))):
            group[i] += value
    for name, totals in groups.items():
        lines.append(f"| {name} | " + " | ".join(map(str, totals)) + " |")
    lines.append("")
    for row in rows:
        for note in row.get("notes", ()):
            lines.append(f"- {row['file']}: {note}")
        for diff in row["differences"]:
            lines.append(f"- {row['file']}::{diff['test']}: "
                         f"{diff['error']}")
        for test in row["newly_passing"]:
            lines.append(f"- {row['file']}::{test}: passes routed only")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+",
                        help="paths or globs relative to keras/src")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds per test (pytest-timeout)")
    parser.add_argument("--file-timeout", type=int, default=3600,
                        help="seconds per file and mode")
    parser.add_argument("--out", help="path prefix of the .md and .json")
    parser.add_argument("--modes", default="plain,routed")
    parser.add_argument(
        "--merge", action="store_true",
        help="the arguments are earlier --out .json files: write one "
        "report of their rows (a later file's row for a test file wins)")
    args = parser.parse_args(argv)
    if args.merge:
        merged = {}
        for path in args.files:
            with open(path) as f:
                merged.update((row["file"], row) for row in json.load(f))
        return _report(list(merged.values()), args.out)
    src = _keras_src()
    paths = []
    for pattern in args.files:
        found = sorted(glob.glob(os.path.join(src, pattern)))
        paths += [p for p in found if p not in paths]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for path in paths:
            name = os.path.relpath(path, src)
            runs, notes = {}, []
            for mode in args.modes.split(","):
                runs[mode], seconds, note = _run_file(
                    path, mode == "routed", args.timeout, args.file_timeout,
                    workdir)
                notes.append(f"{mode}: {seconds} s" + (
                    f" ({note})" if note else ""))
            row = _compare(name, runs.get("plain", {}),
                           runs.get("routed", {}))
            row["notes"] = [", ".join(notes)]
            rows.append(row)
            print(_table([row]).splitlines()[2], flush=True)
    return _report(rows, args.out)


def _report(rows, out):
    text = _table(rows)
    print(text)
    if out:
        with open(out + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    main()
