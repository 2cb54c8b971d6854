"""keras_mirror's imports: folders in layers, and no cycles.

The package's folders (and its top-level modules) sit in `LAYERS`, from
`_compat` (the seam to Keras's and TensorFlow's private names) at the
bottom to the command line at the top: a module imports only from layers
below its own, never up and never sideways, so no folder-level cycle can
form. Callbacks sit below the wrapper, as Keras's callbacks sit below its
trainer: the wrapper assembles them; a callback drives the wrapper only
through the model object it is given.

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

# Bottom to top. A unit is a subpackage (`steps`) or a top-level module
# (`split`); `keras_mirror` is the package's `__init__` (its public names).
LAYERS = (
    ("_compat",),
    ("errors", "split", "version"),
    ("allreduce", "replica_context"),
    ("distribute",),
    ("steps",),
    ("callbacks",),
    ("wrapper",),
    ("verify",),
    ("mirrored_model",),
    ("saving",),
    ("keras_mirror",),
    ("launch",),
    ("demo",),
    ("cli",),
)


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


def unit(module):
    """The layered unit of a module: its subpackage or top-level name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def climbing(graph, layers=LAYERS):
    """Every import from a unit to one in the same or a higher layer."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = unit(module), unit(target)
            if a != b and rank[b] >= rank[a]:
                bad.append(f"{module} -> {target}")
    return bad


def test_every_unit_has_a_layer():
    placed = {u for layer in LAYERS for u in layer}
    units = {unit(m) for m in import_graph()}
    assert units == placed, (
        f"not in LAYERS: {sorted(units - placed)}; "
        f"gone: {sorted(placed - units)}")


def test_climbing_names_an_import_up_or_sideways():
    layers = (("low",), ("a", "b"), ("high",))
    graph = {"p.low.x": {"p.high.y"}, "p.a": {"p.b"}, "p.high.y": {"p.a"},
             "p.b": {"p.low.x"}}
    assert climbing(graph, layers) == ["p.a -> p.b", "p.low.x -> p.high.y"]


def test_no_import_climbs_a_layer():
    bad = climbing(import_graph())
    assert not bad, "imports up or sideways across layers: " + "; ".join(
        bad)
