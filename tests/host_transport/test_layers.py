# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The package's modules form layers: no module imports, at module level
(``if TYPE_CHECKING:`` blocks included), a module that imports it back,
directly or through others. Read from the source (``ast``), nothing run."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "vllm_host_transport"


def _module_level_imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports outside functions."""
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "vllm_host_transport":
                    out.update(f"vllm_host_transport.{a.name}" for a in node.names)
                elif node.module.startswith("vllm_host_transport."):
                    out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(
                    a.name
                    for a in node.names
                    if a.name.startswith("vllm_host_transport.")
                )
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(ast.parse(path.read_text()).body)
    return out


def test_no_import_circle():
    modules = {
        f"vllm_host_transport.{p.stem}": p
        for p in PKG.glob("*.py")
        if p.stem != "__init__"
    }
    graph = {
        m: {d for d in _module_level_imports(p) if d in modules and d != m}
        for m, p in modules.items()
    }
    circles = []

    def walk(node: str, path: list[str]) -> None:
        for dep in graph[node]:
            if dep == path[0]:
                circles.append(" -> ".join([*path, dep]))
            elif dep not in path and dep > path[0]:
                walk(dep, [*path, dep])

    for m in sorted(graph):
        walk(m, [m])
    assert circles == []
