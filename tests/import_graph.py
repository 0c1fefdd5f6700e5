"""The package's import graph, read from the source (no module is executed).

Every module of sarazmq (with kernels/ and procs/ as sarazmq.kernels and sarazmq.procs, as
installed) and, per module, the sarazmq modules it imports: at module level (`eager`) or
inside functions (`lazy`; an import under `if TYPE_CHECKING:` is not an import).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: installed package name -> folder in the checkout
FOLDERS = {
    "sarazmq": ROOT / "sarazmq",
    "sarazmq.kernels": ROOT / "kernels",
    "sarazmq.procs": ROOT / "procs",
}


@dataclass(frozen=True)
class ImportEdge:
    """`importer` imports `target` (a sarazmq module) and these names from it."""

    importer: str
    target: str
    names: tuple[str, ...]
    line: int
    lazy: bool


@dataclass
class ImportGraph:
    modules: dict[str, Path] = field(default_factory=dict)
    edges: list[ImportEdge] = field(default_factory=list)

    def targets(self, module: str, *, lazy: bool = True) -> set[str]:
        """What `module` imports (lazy: also inside functions), with the packages a
        dotted import runs first (importing a.b.c runs a.b's __init__), except its own."""
        out: set[str] = set()
        for e in self.edges:
            if e.importer != module or (e.lazy and not lazy):
                continue
            parts = e.target.split(".")
            for i in range(2, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in self.modules and not _is_ancestor(name, module):
                    out.add(name)
        out.discard(module)
        return out

    def cycles(self, *, lazy: bool = True) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        succ = {m: sorted(self.targets(m, lazy=lazy)) for m in self.modules}

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in succ[v]:
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))

        for m in sorted(self.modules):
            if m not in index:
                visit(m)
        return found


def _is_ancestor(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (x for n in child.orelse for x in _walk_one(n, lazy))
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, True)
        else:
            yield from _walk(child, lazy)


def _walk_one(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, lazy
    else:
        yield from _walk(node, lazy)


def build_graph() -> ImportGraph:
    graph = ImportGraph()
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).parts
            if package == "sarazmq" and rel[0] in ("kernels", "procs"):
                continue
            graph.modules[_module_name(package, folder, path)] = path
    for module, path in graph.modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, lazy in _walk(tree, False):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("sarazmq"):
                        graph.edges.append(
                            ImportEdge(module, _known(graph, alias.name), (), node.lineno, lazy)
                        )
                continue
            base = _absolute(module, is_package, node)
            if not base.startswith("sarazmq"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in graph.modules:  # `from package import module`
                    graph.edges.append(ImportEdge(module, sub, (), node.lineno, lazy))
                else:
                    graph.edges.append(
                        ImportEdge(module, _known(graph, base), (alias.name,), node.lineno, lazy)
                    )
    return graph


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(graph: ImportGraph, name: str) -> str:
    """The longest prefix of `name` that is a module of the graph."""
    while name not in graph.modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name
