"""The house rules: the package's layout, and tests grouped by concept.

- The top of the package holds its public modules only; the helpers live
  in subpackages named for what they hold (`steps/`, `distribute/`, ...).
- Modules hold one concept each, at whatever length it needs: no line cap.
- Tests sit in concept folders (`tests/steps/`, `tests/distribute/`, ...)
  and name behaviour, not the module that holds it today; end-to-end
  tests of the README's promises are in `tests/e2e/`, what the tests
  share in `tests/support/`. Each `_compat` module (the seam to Keras's and
  TensorFlow's private names) has its own test module.
"""

import pathlib

from support import helpers

PACKAGE = helpers.ROOT / "keras_mirror"
TESTS = helpers.ROOT / "tests"

PUBLIC_TOP = {"__init__", "allreduce", "cli", "demo", "errors",
              "mirrored_model", "replica_context", "saving", "split",
              "verify", "version"}

def test_the_package_top_holds_its_public_modules_only():
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == PUBLIC_TOP


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
