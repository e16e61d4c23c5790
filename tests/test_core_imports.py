"""The layering of the serving core: no import circle, and none hidden in a function.

A circle closed by an import inside a function works until someone moves that import, and
it makes every module of the circle load the others. These tests read the source (what
each module imports at module level, outside ``if TYPE_CHECKING``) and import each core
module alone in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "rtserve"
CORE = sorted(p.stem for p in (SRC / "core").glob("*.py") if p.stem != "__init__")
# Layers that the core is built on: none of them may import the core or the transports.
BELOW_CORE = ("observability", "scheduling", "runtime", "protocol", "cache")


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> set[str]:
    """What the module imports when it is imported (not under ``if TYPE_CHECKING``)."""
    found: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(_targets(node))
        elif isinstance(node, ast.If | ast.Try) and not _is_type_checking(node):
            todo.extend(ast.iter_child_nodes(node))  # type: ignore[arg-type]
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        imported = _module_level_imports(ast.parse(path.read_text(), str(path)))
        graph[name] = {m for m in imported if m in files and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_module_level_import_circle_in_the_package() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_core_module_imported_inside_a_function() -> None:
    """An import of ``rtserve.core`` inside a function is how a circle hides."""
    hidden = []
    for path in sorted((SRC / "core").glob("*.py")) + sorted((SRC / "observability").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_level = set(map(id, tree.body))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in module_level:
                continue
            if any(t.startswith("rtserve.core") for t in _targets(node)):
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert hidden == []


def test_the_layers_below_the_core_do_not_import_it() -> None:
    graph = _graph()
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.split(".")[1:2] and name.split(".")[1] in BELOW_CORE
        for target in targets
        if target.startswith(("rtserve.core", "rtserve.server", "rtserve.engine"))
    )
    assert upward == []


def test_the_core_and_the_engine_import_no_transport() -> None:
    """Model control, the dataplane and the Engine work without ``server/``."""
    graph = _graph()
    transport = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith(("rtserve.core", "rtserve.engine"))
        for target in targets
        if target.startswith("rtserve.server")
    )
    assert transport == []


@pytest.mark.parametrize("name", CORE)
def test_each_core_module_imports_alone(name: str) -> None:
    """Imported first, in a fresh interpreter: a circle fails here in some order."""
    subprocess.run(
        [sys.executable, "-c", f"import rtserve.core.{name}"], check=True, cwd=ROOT, timeout=60
    )
