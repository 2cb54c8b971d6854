"""No import cycles between keras_mirror's own modules.

Every module is parsed with `ast`; every `import` and `from ... import`
counts, at module level or inside a function (a function-level import
hides a cycle from Python's import machinery, not from the design), and so
does `importlib.import_module("keras_mirror....")` with a literal name.
Importing a package does not count as importing its parents (Python runs
a parent's `__init__` first, but that is not a dependency of the module).
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_mirror"


def _module_names(package):
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(name, modules):
    """`name` if it is one of ours, else its longest prefix that is."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module, path, modules):
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: the submodule `pkg.name` if it is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}"
                       in modules else base for alias in node.names]
        elif (isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def import_graph(package=PACKAGE):
    """{module: set of the package's own modules it imports}."""
    modules = _module_names(package)
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def find_cycles(graph):
    """Every cycle found by a depth-first search, each as a module list."""
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_find_cycles_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import importlib\nimportlib.import_module('pkg.sub.b')\n")
    (package / "a.py").write_text(
        "import os\n\ndef f():\n    from pkg.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("from .. import a\nfrom . import c\n")
    (package / "sub" / "c.py").write_text("import pkg.a as a\n")
    assert import_graph(package) == {
        "pkg": {"pkg.sub.b"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.sub.c"}, "pkg.sub.c": {"pkg.a"}}
    assert find_cycles(import_graph(package)) == [
        ["pkg.sub.b", "pkg.a", "pkg.sub.b"]]
    assert "keras_mirror.distribute._multi_worker" in import_graph()[
        "keras_mirror"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(
        " -> ".join(c) for c in cycles)
