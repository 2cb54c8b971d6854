"""Setup script; the metadata lives in setup.cfg.

Reads the version from `keras_mirror/version.py` and makes the README's
relative links (`docs/...`, `benchmarks/...`) absolute for the long
description, so that they work on the package index too.
"""

import configparser
import pathlib
import re

import setuptools

_ROOT = pathlib.Path(__file__).parent
_VERSION = re.search(
    r'__version__ = "([^"]+)"',
    (_ROOT / "keras_mirror" / "version.py").read_text(),
).group(1)


def _long_description():
    """The README with relative links pointing at this version's files."""
    config = configparser.ConfigParser()
    config.read(_ROOT / "setup.cfg")
    url = config["metadata"]["url"].rstrip("/")
    text = (_ROOT / "README.md").read_text(encoding="utf-8")

    def absolute(match):
        bang, label, target = match.groups()
        kind = "raw" if bang else "blob"
        return f"{bang}[{label}]({url}/{kind}/v{_VERSION}/{target})"

    # `[label](target)` and `![alt](target)` whose target is a path inside
    # the repository (not a URL, not an `#anchor`).
    return re.sub(r"(!?)\[([^\]]*)\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s]+)\)",
                  absolute, text)


setuptools.setup(
    version=_VERSION,
    long_description=_long_description(),
)
