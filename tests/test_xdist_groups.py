"""The suite's `xdist_group`s take effect (`tests/support/xdist_groups.py`).

The process tests that share ports and network namespaces run one after
another in their group, and a module's fixture is built once, only if
`--dist loadgroup` really groups. pytest 9.2 broke that silently
(pytest-dev/pytest-xdist#1386; setup.cfg pins pytest below it). This runs
a small suite under pytest-xdist, with the suite's own grouping hook, and
reads where each test ran.
"""

import collections
import os
import subprocess
import sys
import textwrap

from support import helpers

CONFTEST = f"""
import sys
sys.path.insert(0, {str(helpers.ROOT / "tests")!r})
import pytest
from support import xdist_groups

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    xdist_groups.group_module_fixtures(items)

@pytest.fixture(scope="module")
def shared():  # as tests/conftest.py's `one_device`
    return {{}}
"""

RECORD = """
import os, pytest

def record(request):
    with open(os.environ["WHERE"], "a") as f:
        f.write(request.node.nodeid + " "
                + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""

MODULES = {
    # A module-scoped fixture: the module is one group.
    "test_fixture.py": RECORD + """
@pytest.fixture(scope="module")
def built():
    return 1

@pytest.mark.parametrize("i", range(4))
def test_reads(built, request, i):
    record(request)
""",
    # A module-scoped fixture of the conftest: the module is one group too.
    "test_conftest_fixture.py": RECORD + """
@pytest.mark.parametrize("i", range(3))
def test_reads(shared, request, i):
    record(request)
""",
    # A named group across two modules, and tests of no group.
    "test_named_a.py": RECORD + """
pytestmark = pytest.mark.xdist_group("net")

@pytest.mark.parametrize("i", range(3))
def test_a(request, i):
    record(request)
""",
    "test_named_b.py": RECORD + """
@pytest.mark.xdist_group("net")
def test_b(request):
    record(request)

@pytest.mark.parametrize("i", range(6))
def test_free(request, i):
    record(request)
""",
}


def test_groups_run_on_one_worker_each(tmp_path):
    # Laid out as the suite is: <root>/pytest.ini, <root>/tests/conftest.py.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(CONFTEST)
    for name, text in MODULES.items():
        (tests / name).write_text(textwrap.dedent(text))
    where = tmp_path / "where.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-n", "3", "--dist", "loadgroup", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), str(tests)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "WHERE": str(where)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers = collections.defaultdict(set)
    counts = collections.Counter()
    for line in where.read_text().splitlines():
        nodeid, worker = line.rsplit(" ", 1)
        group = nodeid.rpartition("@")[2] if "@" in nodeid else None
        workers[group].add(worker)
        counts[group] += 1
    assert counts == {"test_fixture": 4, "test_conftest_fixture": 3,
                      "net": 4, None: 6}, counts
    assert len(workers["test_fixture"]) == 1, workers
    assert len(workers["test_conftest_fixture"]) == 1, workers
    assert len(workers["net"]) == 1, workers
