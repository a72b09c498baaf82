"""The package's import graph: no circles, and no upward imports from the lower layers.

An import from A to B, at module level or inside a function (a lazy import hides a circle,
it does not remove it), is an edge A -> B.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "llm_serving"

# Lower layers: plain data and configuration, imported by everything above them.
LOWER = ("llm_serving.config", "llm_serving.errors", "llm_serving.outputs",
         "llm_serving.sampling_params", "llm_serving.executor.protocol")
UPPER = ("llm_serving.engine", "llm_serving.entrypoints")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("llm_serving")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_no_import_circles():
    graph = _graph()
    # The package's __init__ only re-exports; importing a submodule runs it first anyway.
    graph = {k: {m for m in v if m != "llm_serving"} for k, v in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_lower_layers_never_import_the_engine_or_the_http_layer():
    graph = _graph()
    upward = {low: sorted(m for m in graph[low] if m.startswith(UPPER)) for low in LOWER}
    assert not any(upward.values()), upward
