"""Graphviz DOT of a compiled graph: every region a cluster of its own ops, the ops left to PyTorch
as grey boxes, the data flowing between them.

DOT is plain text (https://graphviz.org/doc/info/lang.html), written here directly: the libraries
that write it (``pydot``, ``pygraphviz``, behind ``torch.fx``'s ``FxGraphDrawer`` and networkx's
``write_dot``) are not dependencies of this package and have no notion of our regions. Parameters
(``get_attr`` nodes) are left out, so the picture shows activations only.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..ir.region import Region, called_region
from ..tables import op_name_of

__all__ = ["to_dot", "BACKEND_COLORS"]

# fill colour of a region cluster per backend that runs it
BACKEND_COLORS = {"cudnn": "#c7e9c0", "dense": "#c6dbef", "triton_stem": "#dadaeb",
                  "triton_conv": "#dadaeb", "reference": "#fdd0a2"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _shape(node: fx.Node) -> str:
    val = node.meta.get("val")
    return "x".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else ""


def _label(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op in ("placeholder", "output"):
        op = node.op if node.op == "output" else f"input {node.name}"
    else:
        op = op_name_of(node, gm)
    shape = _shape(node)
    return f"{op}\\n{shape}" if shape else op


def to_dot(spec: Any, title: str = "") -> str:
    """DOT text (a ``digraph``) of a specialization's lowered graph.

    Each region call becomes ``subgraph cluster_<id>`` holding the region's own ops (labelled
    with id, pattern and backend; filled per :data:`BACKEND_COLORS`); an edge into a region goes
    to the op inside it that reads that input, an edge out of it leaves from the op that produced
    that output. Node labels give the op and the traced output shape (``128x64x32x32``).
    """
    gm: fx.GraphModule = spec.graph_module
    lines = ["digraph fusion_compiler {", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fillcolor="#eeeeee", fontsize=10];']
    if title:
        lines.append(f"  label={_quote(title)}; labelloc=t;")
    produced: dict[fx.Node, str] = {}  # top-level node -> DOT id of the op that made its value
    reads: dict[tuple[fx.Node, int], list[str]] = {}  # (region call, input index) -> readers
    edges: list[tuple[str, str]] = []

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue
        if (region := called_region(gm, node)) is not None:
            _region_cluster(node, region, lines, produced, reads, edges)
            continue
        if node.op == "call_function" and node.target is operator.getitem and \
                node.args[0] in produced and isinstance(produced[node.args[0]], list):
            produced[node] = produced[node.args[0]][node.args[1]]
            continue
        dot_id = f"n_{node.name}"
        shape = "ellipse" if node.op in ("placeholder", "output") else "box"
        lines.append(f"  {_quote(dot_id)} [label={_quote(_label(node, gm))}, shape={shape}];")
        produced[node] = dot_id
        for arg in node.all_input_nodes:
            if isinstance(produced.get(arg), str):
                edges.append((produced[arg], dot_id))
    for (call, i), readers in reads.items():
        arg = call.args[i]
        if isinstance(arg, fx.Node) and isinstance(produced.get(arg), str):
            edges += [(produced[arg], dot_id) for dot_id in readers]
    lines += [f"  {_quote(a)} -> {_quote(b)};" for a, b in dict.fromkeys(edges)]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _region_cluster(call: fx.Node, region: Region, lines: list[str],
                    produced: dict[fx.Node, Any], reads: dict[tuple[fx.Node, int], list[str]],
                    edges: list[tuple[str, str]]) -> None:
    """Append ``region``'s cluster; record where its inputs go and its outputs come from."""
    sub = region.graph_module
    color = BACKEND_COLORS.get(region.backend, "#dddddd")
    label = f"{region.region_id}: {region.pattern}\\n{region.backend}"
    lines += [f"  subgraph cluster_{region.region_id} {{",
              f"    label={_quote(label)}; style=filled; fillcolor={_quote(color)};"]
    inner: dict[fx.Node, str] = {}
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    for node in sub.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        dot_id = f"{region.region_id}_{node.name}"
        inner[node] = dot_id
        lines.append(f"    {_quote(dot_id)} [label={_quote(_label(node, sub))}, "
                     f'fillcolor="white"];')
        for arg in node.all_input_nodes:
            if arg in inner:
                edges.append((inner[arg], dot_id))
            elif arg in placeholders:
                reads.setdefault((call, placeholders.index(arg)), []).append(dot_id)
    lines.append("  }")
    produced[call] = [inner.get(n, "") for n in region.output_nodes]
