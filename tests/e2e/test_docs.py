"""The documentation: the README is one page, the site builds strictly.

`mkdocs build --strict` fails on any warning: a broken link or anchor, a
page in the nav that does not exist, a page that the nav leaves out. The
figures of the performance page are regenerated from the committed JSON
results into a temporary folder and compared with the committed PNGs.
"""

import re
import struct
import subprocess
import sys

import pytest
from support import helpers

ROOT = helpers.ROOT
DOCS = ROOT / "docs"
PAGES = ("index", "guide", "verify", "exactness", "multi-worker", "logging",
         "performance", "errors", "architecture", "changelog")

sys.path.insert(0, str(ROOT / "benchmarks"))
import plot_results  # noqa: E402

sys.path.insert(0, str(DOCS / "hooks"))
import pages  # noqa: E402


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_site_builds_strictly_with_every_page(site):
    for page in PAGES:
        path = site / ("index.html" if page == "index" else
                       f"{page}/index.html")
        assert path.is_file(), page
    assert not (site / "hooks").exists()


def test_readme_is_the_home_page_with_site_links(site):
    home = (site / "index.html").read_text()
    assert "Does each replica get a different batch?" in home
    assert 'href="guide/#api-overview"' in home
    assert 'href="changelog/"' in home
    assert "docs/guide.md" not in home


def test_changelog_page_is_changelog_md(site):
    page = (site / "changelog" / "index.html").read_text()
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(),
                          re.M)
    assert headings[0] == "[Unreleased]"
    for heading in headings:
        assert heading in page, heading


def test_performance_page_shows_the_figures(site):
    page = (site / "performance" / "index.html").read_text()
    for name in plot_results.FIGURES:
        assert f'src="../img/{name}"' in page, name
        assert (site / "img" / name).is_file(), name


def test_readme_links_become_site_links():
    url = "https://github.com/o/r"
    text = ("[a](docs/guide.md#install) [b](CHANGELOG.md) "
            "[c](benchmarks/README.md) [d](https://x.org/y.md) [e](#top) "
            "![f](docs/img/scaling.png)")
    assert pages.readme_as_index(text, url) == (
        "[a](guide.md#install) [b](changelog.md) "
        "[c](https://github.com/o/r/blob/main/benchmarks/README.md) "
        "[d](https://x.org/y.md) [e](#top) ![f](img/scaling.png)")


def test_figures_are_regenerated_from_the_json_results(tmp_path):
    plot_results.main(["--out", str(tmp_path)])
    for name in plot_results.FIGURES:
        committed = DOCS / "img" / name
        assert committed.is_file(), f"run benchmarks/plot_results.py: {name}"
        assert _png_size(tmp_path / name) == _png_size(committed), name


def test_plot_refuses_a_folder_without_results(tmp_path):
    with pytest.raises(FileNotFoundError,
                       match="`--results` must hold a bench_step-"):
        plot_results.main(["--results", str(tmp_path), "--out",
                           str(tmp_path / "img")])


def test_readme_is_one_page_with_the_ci_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split()) <= 1000  # five minutes' reading
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^python3 -m venv .*pytest$", ci, re.M).group(0)
    assert f"```bash\n{command}\n```" in readme
    assert ("```bash\npython3 -m venv .venv && .venv/bin/pip install -q -e "
            "\".[demo]\" && .venv/bin/keras-mirror demo\n```") in readme
    for section in ("## Quickstart", "## Does each replica get a different "
                    "batch?", "## The API in ten lines", "## Check your "
                    "model", "## Documentation"):
        assert section in readme, section
    assert "split_plan" in readme and "mirrored.verify(x, y)" in readme
