"""The wheel and the sdist, built as CI builds them, installed fresh.

One fresh virtual environment (module-scoped) builds both with
`setuptools.build_meta` and stands for a user's environment that already
has a TensorFlow flavour other than `tensorflow`: a `tensorflow-cpu`
distribution record is placed in it (metadata only; nothing here imports
TensorFlow from it). Bounded: the only downloads are `setuptools` (pip's
cache serves it after the first run) and the metadata pip's dry-run
resolver reads.
"""

import email
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
from test_launch import _clean_session  # noqa: F401

from keras_mirror.version import __version__

ROOT = pathlib.Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                               "__pycache__", ".pytest_cache", "runs",
                               "test-artifacts", ".hypothesis", ".ruff_cache")
# TensorFlow distributions (TensorBoard, a declared requirement, is not one).
_TF_NAMES = re.compile(r"^(tensorflow|tf-nightly|tf_nightly)", re.I)


def _call(*argv, timeout=240, **kwargs):
    out = subprocess.run([str(a) for a in argv], capture_output=True,
                         text=True, timeout=timeout, **kwargs)
    assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-2000:])
    return out


def _fake_tensorflow_cpu(python):
    """Records `tensorflow-cpu` 2.21.0 as installed in `python`'s env."""
    purelib = _call(python, "-c", "import sysconfig; "
                    "print(sysconfig.get_paths()['purelib'])").stdout.strip()
    info = pathlib.Path(purelib) / "tensorflow_cpu-2.21.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tensorflow-cpu\nVersion: 2.21.0\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(python of a fresh venv with tensorflow-cpu recorded, wheel, sdist)."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=_SKIP)
    _call(sys.executable, "-m", "venv", tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    _call(python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
          "setuptools>=77")
    dist = tmp / "dist"
    # (build_meta rewrites sys.argv: read the directory first.)
    _call(python, "-c", "import sys; from setuptools import build_meta as b;"
          " out = sys.argv[1]; b.build_sdist(out); b.build_wheel(out)", dist,
          cwd=source)
    _fake_tensorflow_cpu(python)
    wheel = dist / f"keras_mirror-{__version__}-py3-none-any.whl"
    sdist = dist / f"keras_mirror-{__version__}.tar.gz"
    return python, wheel, sdist


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        text = z.read(f"keras_mirror-{__version__}.dist-info/METADATA")
    return email.message_from_bytes(text)


def test_wheel_metadata(env):
    _, wheel, _ = env
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier")
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    assert meta["Author"] and len(meta.get_all("Project-URL")) >= 3
    required = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(r.split("<")[0].split(">")[0] for r in required) == [
        "keras", "numpy", "rich", "tensorboard"]
    # The long description's links work on the package index too.
    body = meta.get_payload()
    links = re.findall(r"\]\(([^)]+)\)", body)
    assert links and all(link.startswith(("https://", "#")) for link in links)


def test_wheel_installs_beside_tensorflow_cpu_without_a_second_tf(env):
    python, wheel, _ = env
    report = wheel.parent / "report.json"
    _call(python, "-m", "pip", "install", "--dry-run", "-q",
          "--disable-pip-version-check", "--report", report, wheel)
    names = [item["metadata"]["name"]
             for item in json.loads(report.read_text())["install"]]
    assert "keras-mirror" in names and "keras" in names
    assert not [n for n in names if _TF_NAMES.match(n)], names


def test_installed_console_script_reports_its_version(env):
    python, wheel, _ = env
    _call(python, "-m", "pip", "install", "-q", "--no-deps",
          "--disable-pip-version-check", wheel)
    script = python.parent / "keras-mirror"
    out = _call(script, "--version")
    assert out.stdout == f"keras-mirror {__version__}\n"


def test_sdist_carries_what_its_tests_need_and_they_run(env, tmp_path):
    _, _, sdist = env
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    top = tmp_path / f"keras_mirror-{__version__}"
    for path in ("LICENSE", "CHANGELOG.md", "README.md", "docs/errors.md",
                 "mkdocs.yml", "docs/hooks/pages.py", "docs/img/scaling.png",
                 "examples/gan.py", "tests/conftest.py", "tests/helpers.py",
                 "tests/stock_fit.py", "tests/workers/toy_worker.py",
                 "benchmarks/README.md"):
        assert (top / path).is_file(), path
    env_vars = {**os.environ, "PYTHONPATH": str(top)}
    chosen = "element_spec or capacity or open_shapes or docs_table"
    out = _call(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "-n", "0", "tests/test_inputs.py", "-k", chosen,
                "tests/test_errors.py::test_docs_table_lists_every_case",
                cwd=top, env=env_vars)
    assert re.search(r"\b4 passed\b", out.stdout), out.stdout[-1500:]
    # The tests ran the sdist's own package, not the checkout's.
    out = _call(sys.executable, "-c", "import keras_mirror; "
                "print(keras_mirror.__file__)", cwd=top, env=env_vars)
    assert out.stdout.startswith(str(top))
