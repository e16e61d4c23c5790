"""The shape of the code base as a whole: no import circle anywhere (in ``src/`` and
``bench/``, counting imports inside functions, which is how a circle hides), and no
function so long that it reads as a chapter.

The package root's lazy ``Engine`` accessor (``rtserve.__getattr__``) is the one
function-level import left out: every ``import rtserve.x`` loads the root first anyway,
so an edge into the root closes no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = {"rtserve": ROOT / "src" / "rtserve", "bench": ROOT / "bench"}
MAX_FUNCTION_LINES = 120


def _files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for base in TREES.values():
        for path in base.rglob("*.py"):
            if any(part.startswith(".") for part in path.relative_to(base).parts):
                continue  # bench/.peers: the peers' own virtual environments
            parts = path.relative_to(base.parent).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(path: Path, module: str) -> set[str]:
    """Every module the file imports, at module level or inside functions, outside
    ``if TYPE_CHECKING`` blocks."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _graph() -> dict[str, set[str]]:
    files = _files()
    roots = set(TREES)
    return {
        name: {m for m in _imports(path, name) if m in files and m != name and m not in roots}
        for name, path in files.items()
    }


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return groups


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_are_seen() -> None:
    graph = _graph()
    # optimize.pipeline imports optimize.edge inside a function (a heavy, optional step).
    assert "rtserve.optimize.edge" in graph["rtserve.optimize.pipeline"]


def test_no_import_circle_in_src_or_bench() -> None:
    circles = _circles(_graph())
    assert circles == [], "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_function_longer_than_a_screenful_or_two() -> None:
    long = []
    for path in _files().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(sorted(long))
