"""The suite's `xdist_group`s: a module with a module-scoped fixture is one.

`--dist loadgroup` (setup.cfg) spreads a module's tests over the workers,
and each worker would build the module's fixture again (the examples' run,
the packaging venv): `group_module_fixtures` makes such a module one group,
unless its tests already name theirs. Imports pytest only, so that
`tests/test_xdist_groups.py` can run it in a small pytest of its own.
"""

import pytest


def group_module_fixtures(items):
    """Marks each item of a module with a module-scoped fixture (in place)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        defs = getattr(item, "_fixtureinfo", None)
        for fixturedefs in (defs.name2fixturedefs.values() if defs else ()):
            fixture = fixturedefs[-1]
            if fixture.scope == "module":
                item.add_marker(pytest.mark.xdist_group(item.module.__name__))
                break
