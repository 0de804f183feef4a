"""The package's layers import one way: each module imports only modules of its own layer or of
the layers below it (:data:`LAYERS`, bottom first), ``runtime`` only ``ir`` besides itself, and no
modules import each other in a circle. Every import counts: relative and absolute, at module
level and inside functions (lazy), the package root included."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "fusion_compiler"
ROOT = "fusion_compiler"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ir", ("fusion_compiler.ir",)),
    ("config", ("fusion_compiler.config",)),
    ("runtime", ("fusion_compiler.runtime",)),
    ("kernels", ("fusion_compiler.kernels",)),
    ("capture", ("fusion_compiler.capture", "fusion_compiler.tracing",
                 "fusion_compiler.code_reads", "fusion_compiler.process_state",
                 "fusion_compiler.random_ops", "fusion_compiler.shapes",
                 "fusion_compiler.grad_modes", "fusion_compiler.trace_constants",
                 "fusion_compiler.parametrized_calls", "fusion_compiler.output_types",
                 "fusion_compiler.dynamo_capture", "fusion_compiler.tensor_reads")),
    ("autograd", ("fusion_compiler.autograd",)),
    ("passes", ("fusion_compiler.passes",)),
    ("backends", ("fusion_compiler.backends",)),
    ("lowering", ("fusion_compiler.lowering",)),
    ("front doors", ("fusion_compiler.glue_compile", "fusion_compiler.graphing",
                     "fusion_compiler.runners", "fusion_compiler.specialization",
                     "fusion_compiler.tables", "fusion_compiler.input_errors",
                     "fusion_compiler.compiler",
                     "fusion_compiler.dynamo")),
    ("tools", ("fusion_compiler.tools",)),
    ("package root", ("fusion_compiler",)),
]
"""The layers, bottom first, each with the modules and folders (packages) it holds."""

ONLY = {"runtime": {"ir", "runtime"}}
"""Layers that may import only these layers, whatever lies below them."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def layer_of(module: str) -> str:
    """The layer of ``module``: the layer whose entry is its longest prefix (the package root's
    entry is the root module alone)."""
    best, length = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            inside = module.startswith(prefix + ".") and prefix != ROOT
            if (module == prefix or inside) and len(prefix) > length:
                best, length = name, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def import_graph() -> nx.DiGraph:
    """Edges module -> module of this package it imports (relative or absolute, at any depth of
    the code; ``from package import name`` counts the submodule ``name`` when it is one)."""
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        graph.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == ROOT]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == ROOT:
                    target = node.module
                else:
                    continue
                targets = [target, *(f"{target}.{a.name}" for a in node.names)]
            else:
                continue
            for name in targets:
                if _exists(name) and name != module and not module.startswith(name + "."):
                    graph.add_edge(module, name)
    return graph


def test_no_import_circles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles == [], cycles


def test_imports_point_down_the_layers():
    order = [name for name, _ in LAYERS]
    wrong = []
    for module, target in import_graph().edges:
        mine, theirs = layer_of(module), layer_of(target)
        allowed = ONLY.get(mine)
        if (allowed is not None and theirs not in allowed) or \
                order.index(theirs) > order.index(mine):
            wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_every_module_is_in_a_layer_and_at_most_400_lines():
    for path in PACKAGE.rglob("*.py"):
        layer_of(_module_name(path))
        lines = len(path.read_text().splitlines())
        assert lines <= 400, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"


def test_the_graph_sees_lazy_and_absolute_imports():
    graph = import_graph()
    assert graph.has_edge("fusion_compiler.backends",
                          "fusion_compiler.backends.cudnn.backend")  # lazy
    assert graph.has_edge("fusion_compiler.backends.cudnn.backward",
                          "fusion_compiler.backends.cudnn.plan")
    assert graph.has_edge("fusion_compiler", "fusion_compiler.compiler")  # the package root
    assert layer_of("fusion_compiler.tools.bench.timing") == "tools"
    assert layer_of("fusion_compiler") == "package root"
