"""The package's import graph: no module of cgp imports another that imports it back, at
module level or inside a function (an import inside a function only defers the circle)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: the top-level folders kernels/, models/ and datasets/ install
# as cgp.kernels, cgp.models and cgp.datasets.
FOLDERS = {"cgp": ROOT / "cgp", "cgp.kernels": ROOT / "kernels", "cgp.models": ROOT / "models",
           "cgp.datasets": ROOT / "datasets"}


def modules():
    """Dotted name -> source file of every module of the package."""
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package] + parts)] = path
    return found


def imported(tree, known):
    """The modules of `known` that a module's syntax tree imports, anywhere in it: for
    `from a.b import c`, a.b.c where that is a module, else a.b; a name not itself a module
    stands for the nearest package above it that is."""
    def nearest(name):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(nearest(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else nearest(node.module))
    names.discard("")
    return names


def import_graph():
    known = modules()
    return {name: imported(ast.parse(path.read_text(), str(path)), known) - {name}
            for name, path in known.items()}


def cycle(graph):
    """One circle of imports as a list of modules (the first again at its end), or None."""
    state = {}   # module -> "open" while on the path being explored, "done" after

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other, path + [other])
                if found:
                    return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert {"cgp.kernels", "cgp.models", "cgp.datasets", "cgp.cli"} <= set(graph)
    assert "cgp.options" in graph["cgp.cli"]                  # module level, from-import
    assert "cgp.models" in graph["cgp.options"]               # inside a function
    assert "cgp.runtime.fpenv" in graph["cgp.cli"]            # from cgp.runtime import fpenv
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_back():
    found = cycle(import_graph())
    assert found is None, "import circle: " + " -> ".join(found)
