"""`keras-mirror`: one argparse program; exact usage, help and errors."""

import json
import subprocess
import sys
import types

import pytest

from keras_mirror import cli
from keras_mirror import demo
from keras_mirror.version import __version__


def _run(*argv, code=None):
    """Runs the console script's `main` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", code or
         "import sys; from keras_mirror import cli; sys.exit(cli.main())",
         *argv], capture_output=True, text=True, timeout=60,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin",
             "PYTHONPATH": ":".join(sys.path)})


# Every command line the tests below check, answered by `cli.main` in one
# fresh interpreter (one start-up instead of one per command line), each
# with its own captured stdout, stderr and exit code.
USAGE_ERRORS = [
    (["demo", "--replicas", "0"],
     "argument --replicas: must be a positive integer, got '0'"),
    (["demo", "--batch-size", "ten"],
     "argument --batch-size: must be a positive integer, got 'ten'"),
    (["demo", "--target", "95"],
     "argument --target: must be a number from 0 to 1, got '95'"),
    (["demo", "--execution", "graph"],
     "argument --execution: invalid choice: 'graph' (choose from 'auto', "
     "'strategy')"),
]
ARGVS = [[], ["--version"], ["demo", "--help"], ["dmeo"], ["launch", "--help"],
         *(argv for argv, _ in USAGE_ERRORS)]
_EACH = """\
import contextlib, io, json, sys
from keras_mirror import cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    results.append([0 if code is None else code, out.getvalue(),
                    err.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def answers():
    """{argv tuple: (returncode, stdout, stderr)} for every one of ARGVS."""
    done = _run(json.dumps(ARGVS), code=_EACH)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    return {tuple(a): types.SimpleNamespace(
        returncode=r[0], stdout=r[1], stderr=r[2])
        for a, r in zip(ARGVS, results)}


USAGE = "usage: keras-mirror [-h] [--version] {demo,launch} ...\n"

HELP = USAGE + """
Exact synchronous data-parallel training of an existing Keras 3 model on
tf.distribute.

options:
  -h, --help     show this help message and exit
  --version      show program's version number and exit

subcommands:
  {demo,launch}
    demo         train a small convnet on scikit-learn's digits over CPU
                 replicas
    launch       start N local workers of a training script with TF_CONFIG set
                 (options: `keras-mirror launch --help`)

Run `keras-mirror <subcommand> --help` for a subcommand's options.
"""

DEMO_HELP = """\
usage: keras-mirror demo [-h] [--replicas N] [--epochs N] [--batch-size B]
                         [--log-dir DIR] [--target ACC] [--seed SEED]
                         [--gradient-dtype {float32,bfloat16,float16}]
                         [--execution {auto,strategy}]

Train a small convnet on scikit-learn's bundled digits data (no download)
across logical CPU replicas; print the split plan, Keras's progress bar and a
per-replica table, and check the test accuracy against --target (exit code 1
below it).

options:
  -h, --help            show this help message and exit
  --replicas N          logical CPU replicas (default: 4)
  --epochs N            epochs to train (default: 20)
  --batch-size B        global batch size, split across the replicas (default:
                        100)
  --log-dir DIR         write one TensorBoard run per replica here (default:
                        none)
  --target ACC          test accuracy the demo must reach (default: 0.95)
  --seed SEED           seed of the weights and the shuffling (default: 0)
  --gradient-dtype {float32,bfloat16,float16}
                        dtype of the gradient all-reduce (default: the
                        gradients' own, float32)
  --execution {auto,strategy}
                        MirroredModel execution path (default: auto)
"""


def test_no_subcommand_prints_usage(answers):
    out = answers[()]
    assert (out.returncode, out.stdout, out.stderr) == (2, HELP, "")


def test_version(answers):
    out = answers[("--version",)]
    assert (out.returncode, out.stdout) == (0, f"keras-mirror {__version__}\n")


def test_demo_help_shows_every_default(answers):
    out = answers[("demo", "--help")]
    assert (out.returncode, out.stdout) == (0, DEMO_HELP)


@pytest.mark.parametrize("argv, message", USAGE_ERRORS)
def test_errors_name_the_flag(argv, message, answers):
    out = answers[tuple(argv)]
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == f"keras-mirror demo: error: {message}"


def test_unknown_subcommand(answers):
    out = answers[("dmeo",)]
    assert out.returncode == 2
    assert out.stderr == USAGE + (
        "keras-mirror: error: argument {demo,launch}: invalid choice: 'dmeo' "
        "(choose from 'demo', 'launch')\n")


def test_launch_is_delegated_to_its_own_parser(answers):
    out = answers[("launch", "--help")]
    assert out.returncode == 0
    assert out.stdout.startswith("usage: keras-mirror launch [-h]")


def test_help_and_version_import_no_tensorflow():
    out = _run(code="import sys\nfrom keras_mirror import cli\n"
               "for argv in (['--help'], ['--version'], ['demo', '-h']):\n"
               "    try:\n        cli.main(argv)\n"
               "    except SystemExit:\n        pass\n"
               "print('tensorflow' in sys.modules)")
    assert out.stdout.endswith("\nFalse\n")


def test_demo_without_scikit_learn_says_what_to_install():
    # `sys.modules[name] = None` makes `find_spec` report it missing.
    out = _run(code="import sys; sys.modules['sklearn'] = None; "
               "from keras_mirror import cli; code = cli.main(['demo']); "
               "print(code, 'tensorflow' in sys.modules)")
    assert out.stdout == "1 False\n"  # answered before importing TensorFlow
    assert out.stderr == (
        "keras-mirror demo needs scikit-learn, which is not installed. "
        'Install with:\n\n    pip install "keras-mirror[demo]"\n\n')


def test_demo_hint_keeps_another_tensorflow_flavour(monkeypatch):
    # `keras-mirror[demo]` brings `tensorflow`: beside tensorflow-cpu the
    # hint names scikit-learn alone, so following it adds no second TF.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setattr(demo, "_installed",
                        lambda name: name == "tensorflow-cpu")
    assert demo.missing_requirements() == (
        "keras-mirror demo needs scikit-learn, which is not installed. "
        'Install with:\n\n    pip install "scikit-learn>=1.3"\n')
    monkeypatch.setattr(demo, "_installed", lambda name: name == "tensorflow")
    assert demo.INSTALL_DEMO in demo.missing_requirements()


def test_main_returns_usage_code_in_process(capsys):
    assert cli.main([]) == 2
    assert capsys.readouterr().out.startswith(USAGE)
