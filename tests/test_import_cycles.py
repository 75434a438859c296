"""Our modules import one another without a cycle: each layer (common, then scheduler_proc / workers /
frontend, then launch.py) can be read, and imported, without the ones above it.

The graph has an edge A -> B for every import of our module B that runs when A is imported: statements at
module level, in a class body, or under `if` / `try` / `with` there; not inside a function, not under
`if TYPE_CHECKING:` (annotations only), nor under `if __name__ == "__main__":` (script use only).
`from P import name` counts as importing the submodule P.name when there is one, else P itself, so a
package's `__init__` re-exports are edges from the package to the modules it re-exports. Importing P.M runs
P's `__init__` first, but that implicit edge M -> P is not counted: every package that re-exports its
modules would otherwise be a cycle.

A second check counts the `if TYPE_CHECKING:` imports too: two modules that name each other's types are one
design split in two files, even when Python can import them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "frontend", "scheduler_proc", "workers", "gpu_kernels", "deltaserve")
SCRIPTS = ("launch.py",)

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def module_files(root: Path, packages: tuple[str, ...], scripts: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py of `packages` (recursively) and the top-level `scripts`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for script in scripts:
        modules[Path(script).stem] = root / script
    return modules


def _is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`: its block runs when the module is a script, never when it is imported."""
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_TRY_BLOCKS = tuple(getattr(ast, kind) for kind in ("Try", "TryStar") if hasattr(ast, kind))  # except* is 3.11+


def import_time_statements(body: list[ast.stmt], type_checking: bool = False) -> Iterator[ast.stmt]:
    """The statements of `body` that run when the module is imported, nested blocks included (and those
    under `if TYPE_CHECKING:` with `type_checking`)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        if isinstance(node, ast.If):
            if _is_main_guard(node.test):
                continue
            if type_checking or not _is_type_checking(node.test):
                yield from import_time_statements(node.body, type_checking)
            yield from import_time_statements(node.orelse, type_checking)
        elif isinstance(node, _TRY_BLOCKS):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from import_time_statements(block, type_checking)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While, ast.ClassDef)):
            yield from import_time_statements(node.body, type_checking)
            yield from import_time_statements(getattr(node, "orelse", []), type_checking)


def imported_modules(name: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> dict[str, int]:
    """Our modules that importing module `name` (file `path`) imports, with the line of each first import."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in import_time_statements(tree.body, type_checking):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            if target in modules and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES, scripts: tuple[str, ...] = SCRIPTS,
                 type_checking: bool = False) -> Graph:
    """The import graph of our modules (`type_checking`: with the imports under `if TYPE_CHECKING:` too)."""
    modules = module_files(root, packages, scripts)
    return {name: imported_modules(name, path, modules, type_checking) for name, path in modules.items()}


def strongly_connected(graph: Graph) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def cycles(graph: Graph) -> list[list[str]]:
    """The components of `graph` that hold a cycle (more than one module: no module imports itself here)."""
    return [c for c in strongly_connected(graph) if len(c) > 1]


def one_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A path A -> B -> ... -> A through modules of `component` (a strongly connected component)."""
    members = set(component)
    path = [component[0]]
    seen = {component[0]}
    while True:
        nxt = sorted(m for m in graph[path[-1]] if m in members)
        back = [m for m in nxt if m in seen]
        if back:
            return path[path.index(back[0]):] + [back[0]]
        path.append(nxt[0])  # a strongly connected component: every member has an edge into it
        seen.add(nxt[0])


def describe(graph: Graph, component: list[str]) -> str:
    """The modules of a cycle and one path around it, each hop with the line of its import."""
    path = one_cycle(graph, component)
    hops = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(path, path[1:])]
    return f"{len(component)} modules {component}, e.g. " + "; ".join(hops)


def unexpected_cycles(graph: Graph) -> str:
    """Every cycle of `graph`, described; "" when there is none."""
    return "\n".join(describe(graph, c) for c in cycles(graph))


# ============================================================================ the repository
def test_our_modules_import_one_another_without_a_cycle() -> None:
    found = unexpected_cycles(import_graph())

    assert not found, f"import cycles:\n{found}"


def test_no_cycle_runs_through_type_checking_imports_either() -> None:
    found = unexpected_cycles(import_graph(type_checking=True))

    assert not found, f"import cycles (counting `if TYPE_CHECKING:` imports):\n{found}"


def test_the_graph_holds_the_imports_it_should() -> None:
    graph = import_graph()

    assert {"common.protocol", "common.curve"} <= set(graph["common.ipc"])
    assert "common.protocol.codec" in graph["common.protocol.worker"]
    assert {"common.protocol.codec", "common.protocol.worker"} <= set(graph["common.protocol"])
    assert "workers.request_state" in graph["workers.input_batch"]
    assert "workers.input_batch" not in import_graph(type_checking=True)["workers.logits_processing"]


# ============================================================================ the checker itself
def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")


def test_a_cycle_through_a_package_re_export_is_found_and_named(tmp_path: Path) -> None:
    write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "import os\nfrom pkg import b\nA = 1\n",
        "pkg/b.py": "from .c import C\n",
        "pkg/c.py": "if True:\n    from pkg import A\nC = 2\n",
    })
    graph = import_graph(tmp_path, ("pkg",), ())

    assert graph == {"pkg": {"pkg.a": 1}, "pkg.a": {"pkg.b": 2}, "pkg.b": {"pkg.c": 1}, "pkg.c": {"pkg": 2}}
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.c"]]
    assert describe(graph, cycles(graph)[0]).endswith("pkg.c (line 2) -> pkg")


def test_imports_in_functions_and_under_type_checking_are_not_edges(tmp_path: Path) -> None:
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from pkg.a import X\nelse:\n    import pkg.c\n"
                     "def f():\n    from pkg import a\n"
                     "class K:\n    from pkg import d\n"
                     "if __name__ == '__main__':\n    import pkg.a\n"),
        "pkg/c.py": "try:\n    import pkg.a as a\nexcept ImportError:\n    a = None\n",
        "pkg/d.py": "",
    })
    graph = import_graph(tmp_path, ("pkg",), ())

    assert graph["pkg.b"] == {"pkg.c": 5, "pkg.d": 9}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]  # through the try block of c, not through f or TYPE_CHECKING
    assert import_graph(tmp_path, ("pkg",), (), type_checking=True)["pkg.b"] == {"pkg.a": 3, "pkg.c": 5, "pkg.d": 9}
