"""The asyncrl package has no import cycles, read from the source with `ast` (nothing is imported).

Every `import` counts, at module level and inside functions (a function-level import hides a
cycle from the interpreter, not from a reader), `if TYPE_CHECKING:` ones included (a layering
cycle even when only types cross it). Relative imports are resolved against the importing module;
`from pkg import name` is an edge to the submodule `pkg.name` when `name` is one, else to `pkg`.
A second test plants a cycle in a tiny package under tmp_path and checks the checker reports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "asyncrl"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package at `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name `from <level dots><target> import ...` refers to inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its source)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                while target and target not in modules:  # `import pkg.mod.attr`-like: the module part
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected component of more than one module,
    and every self-contained loop of the graph is inside one of them (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, c) for c in sorted(components)]


def _cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """The shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")  # a component always has one


def _report(cycles: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(import_graph(PACKAGE_ROOT))
    assert not cycles, _report(cycles)


def test_the_graph_sees_the_package():
    graph = import_graph(PACKAGE_ROOT)
    assert "asyncrl.launch" in graph and "asyncrl.actors.rollout" in graph
    assert "asyncrl.job.runtime" in graph["asyncrl.launch"]  # a function-level import counts


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_planted_cycle_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import helper\n",                                   # a -> b
        "pkg/b.py": "def helper():\n    from . import c\n    return c\n",            # b -> c (function level, relative)
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",  # c -> a
        "pkg/d.py": "import pkg.a\nfrom pkg import sub\n",                           # d -> a, d -> pkg.sub (no cycle)
        "pkg/sub/__init__.py": "from .. import d\n",                                 # sub -> d: d <-> sub
        "pkg/e.py": "from pkg.c import TYPE_CHECKING\nfrom pkg import e\nimport os\n",  # a name, itself, outside
    })
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a", "pkg.sub"} and graph["pkg.sub"] == {"pkg.d"}
    assert graph["pkg.e"] == {"pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.sub", "pkg.d"]]


def test_an_acyclic_package_has_no_cycle(tmp_path):
    pkg = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "import pkg\n"})
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg"}}
    assert find_cycles(graph) == []
