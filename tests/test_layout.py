"""The house rules: the package's layout, and tests that mirror it.

- No module of `keras_mirror` is over 400 lines.
- The top of the package holds its public modules only; the helpers live
  in subpackages named for what they are.
- Each module `keras_mirror/<sub>/<name>.py` has its test module
  `tests/<sub>/test_<name>.py` (a leading underscore dropped), or is
  listed in `COVERED_BY` with the test module that exercises it, whose
  docstring names it. End-to-end tests of the README's promises are in
  `tests/e2e/`; what the tests share is in `tests/support/`.
"""

import pathlib

from support import helpers

PACKAGE = helpers.ROOT / "keras_mirror"
TESTS = helpers.ROOT / "tests"
MAX_LINES = 400

PUBLIC_TOP = {"__init__", "allreduce", "cli", "demo", "errors",
              "mirrored_model", "replica_context", "saving", "split",
              "verify", "version"}

# Modules whose tests live in another module's test file: module -> the
# test module (relative to tests/) that exercises it. Each is small or is
# one half of a pair that is only meaningful tested together.
COVERED_BY = {
    "version": "e2e/test_packaging.py",
    "allreduce": "steps/test_execution.py",
    "distribute/_pipeline_graph": "distribute/test_virtual_shards.py",
    "steps/_own_rows": "distribute/test_own_rows.py",
    "distribute/_strategies": "distribute/test_devices.py",
    "launch/__init__": "launch/test_launch.py",
    "launch/_arguments": "launch/test_launch.py",
    "launch/_ports": "launch/test_launch.py",
    "launch/_supervise": "launch/test_launch.py",
    "launch/_workers": "launch/test_launch.py",
    "steps/strategy": "steps/test_execution.py",
    "steps/dispatch": "steps/test_execution.py",
    "steps/_capacity": "test_mirrored_model.py",
    "steps/_state": "steps/test_one_trace.py",
    "steps/_metric_weights": "steps/test_stand_in.py",
    "steps/_mixing": "steps/test_whole_batch.py",
    "steps/_reductions": "steps/test_probing.py",
    "steps/_loss_kinds": "steps/test_probing.py",
    "steps/_scope": "steps/test_execution.py",
    "steps/_slicing": "steps/test_sparse.py",
    "wrapper/_arguments": "test_errors.py",
    "wrapper/_rebuild": "test_mirrored_model.py",
    "wrapper/_rendering": "test_mirrored_model.py",
    "wrapper/_replica_attributes": "test_mirrored_model.py",
    "wrapper/_resume": "callbacks/test_step_backup.py",
    "wrapper/_contents": "wrapper/test_validate.py",
    "wrapper/_first": "wrapper/test_fit_input.py",
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        yield path, "/".join(rel.parts)


def _own_test(module):
    parts = module.split("/")
    name = parts[-1].lstrip("_")
    return TESTS.joinpath(*parts[:-1], f"test_{name}.py")


def test_no_module_is_over_400_lines():
    long = {module: n for path, module in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_package_top_holds_its_public_modules_only():
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == PUBLIC_TOP


def test_every_module_has_its_test_module():
    missing = []
    for _, module in _modules():
        if module.endswith("__init__") and module != "launch/__init__":
            continue  # re-exports, tested through what they export
        if module.startswith("_compat/"):
            continue  # tests/compat/ mirrors it (next test)
        if _own_test(module).exists():
            assert module not in COVERED_BY, (
                f"{module} has its own test module; drop it from COVERED_BY")
            continue
        if module not in COVERED_BY:
            missing.append(module)
    assert not missing, (
        f"modules with no test module (tests/<sub>/test_<name>.py) and no "
        f"COVERED_BY entry: {missing}")


def test_covering_test_modules_name_what_they_cover():
    unnamed = []
    for module, test in COVERED_BY.items():
        path = TESTS / test
        assert path.exists(), (module, test)
        if f"`keras_mirror/{module}.py`" not in path.read_text():
            unnamed.append((module, test))
    assert not unnamed, f"test modules that do not name what they cover: "\
        f"{unnamed}"


def test_compat_modules_have_their_tests():
    for path in (PACKAGE / "_compat").glob("*.py"):
        if path.stem == "__init__":
            continue
        test = TESTS / "compat" / f"test_{path.stem.lstrip('_')}.py"
        assert test.exists(), test


def test_no_test_module_outside_the_layout():
    """Test modules sit beside their package's tests, not at random."""
    folders = {"", "callbacks", "compat", "distribute", "e2e", "launch",
               "steps", "wrapper"}
    stray = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
             if str(p.parent.relative_to(TESTS)).replace(".", "")
             not in folders and "support" not in p.parts]
    assert not stray, stray
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), "two test modules share a name"


def test_layout_rules_see_this_checkout():
    assert pathlib.Path(__file__).resolve().parent == TESTS.resolve()
    assert (PACKAGE / "mirrored_model.py").exists()
