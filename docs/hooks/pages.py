"""MkDocs hook: two site pages come from files at the repository root.

`index.md` is README.md, with its links made site links (`docs/guide.md`
-> `guide.md`, `CHANGELOG.md` -> `changelog.md`, any other repository path
-> its page on GitHub), and `changelog.md` is CHANGELOG.md. Both files stay
where GitHub, the package index and Keep a Changelog expect them, and the
site has no second copy to keep in sync.
"""

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[2]
# `[label](target)` or `![alt](target)` whose target is a repository path
# (not a URL, not an `#anchor`).
_LINK = re.compile(r"(!?\[[^\]]*\])\((?![a-z][a-z0-9+.-]*:|#)([^)\s]+)\)")


def site_link(target, repo_url):
    """A README link target as seen from the site's home page."""
    path, hash_, anchor = target.partition("#")
    if path.startswith("docs/"):
        return path[len("docs/"):] + hash_ + anchor
    if path == "CHANGELOG.md":
        return "changelog.md" + hash_ + anchor
    return f"{repo_url.rstrip('/')}/blob/main/{target}"


def readme_as_index(text, repo_url):
    return _LINK.sub(
        lambda m: f"{m.group(1)}({site_link(m.group(2), repo_url)})", text)


def on_files(files, config):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(
        config, "index.md", content=readme_as_index(readme, config.repo_url)))
    files.append(File.generated(
        config, "changelog.md",
        content=(ROOT / "CHANGELOG.md").read_text(encoding="utf-8")))
    return files
