"""Setup script; the metadata lives in setup.cfg."""

import pathlib
import re

import setuptools

_VERSION_FILE = pathlib.Path(__file__).parent / "keras_mirror" / "version.py"
_VERSION = re.search(
    r'__version__ = "([^"]+)"', _VERSION_FILE.read_text()
).group(1)

setuptools.setup(version=_VERSION)
