"""The package's modules import one way (capture -> passes -> lowering -> runtime, tools on top):
no circle of imports, lazy ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "fusion_compiler"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> nx.DiGraph:
    """Edges module -> module it imports (relative imports, at any depth of the code); the
    package root ``fusion_compiler`` itself is left out (it imports the front doors)."""
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for name in (target, *(f"{target}.{a.name}" for a in node.names)):
                if _exists(name) and name not in (module, "fusion_compiler") \
                        and not module.startswith(name + "."):
                    graph.add_edge(module, name)
    return graph


def test_no_import_circles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles == [], cycles


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert graph.has_edge("fusion_compiler.backends",
                          "fusion_compiler.backends.cudnn.backend")  # lazy
    assert graph.has_edge("fusion_compiler.backends.cudnn.backward",
                          "fusion_compiler.backends.cudnn.plan")
