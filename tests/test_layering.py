"""The package's layers point one way, and module-level imports form no cycle.

Layers, top to bottom: __main__ -> cli -> benchmarks -> entrypoints -> frontend -> core -> executor ->
worker -> model -> layers, with the base (config, protocol, transport, metrics and the small
shared modules) beneath them all. A module may import its own layer or lower ones; the base
imports only the base. Imports inside functions count too: deferring an import does not change
which way a dependency points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenmill"
LAYERS = ["__main__", "cli", "benchmarks", "entrypoints", "frontend", "core", "executor", "worker", "model", "layers"]
BASE_RANK = len(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def rank(module: str) -> int | None:
    """The layer of `tokenmill.x...`; None for the package's own `__init__` (its public face)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    top = parts[1]
    return LAYERS.index(top) if top in LAYERS else BASE_RANK


def imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # what runs at import: module-level statements, `if TYPE_CHECKING:` aside
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and not _is_type_checking_block(stmt)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("tokenmill"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tokenmill"))
    return found


def _is_type_checking_block(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        src = rank(module)
        if src is None:
            continue
        for target in targets:
            dst = rank(target)
            if dst is not None and dst < src:
                bad.append(f"{module} imports {target} (a higher layer)")
    return bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt in graph and not state.get(nxt):
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_lower_layers_never_import_higher_ones():
    modules = all_modules()
    graph = {name: imports(path, top_level_only=False) for name, path in modules.items()}
    assert not layering_violations(graph), "\n".join(layering_violations(graph))


def test_module_level_imports_form_no_cycle():
    modules = all_modules()
    graph = {name: {t for t in imports(path, top_level_only=True) if t in modules}
             for name, path in modules.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("graph,expected", [
    ({"tokenmill.worker.worker": {"tokenmill.core.scheduler"}}, "tokenmill.worker.worker imports tokenmill.core"),
    ({"tokenmill.metrics.stats_logger": {"tokenmill.core.scheduler"}}, "metrics.stats_logger imports"),
    ({"tokenmill.benchmarks.throughput": {"tokenmill.cli"}}, "benchmarks.throughput imports tokenmill.cli"),
])
def test_the_checks_catch_an_upward_import(graph, expected):
    assert any(expected in v for v in layering_violations(graph))


def test_the_checks_catch_a_cycle():
    graph = {"tokenmill.a": {"tokenmill.b"}, "tokenmill.b": {"tokenmill.c"}, "tokenmill.c": {"tokenmill.a"}}
    assert find_cycle(graph) == ["tokenmill.a", "tokenmill.b", "tokenmill.c", "tokenmill.a"]
