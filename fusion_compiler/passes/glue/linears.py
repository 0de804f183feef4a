"""A glue rewrite for Inductor (applied to the copy of a lowered graph that Inductor compiles,
never to the graph that runs eagerly): a linear layer with a small weight (an SE block's squeeze
and excitation layers: 64x4 to 512x32 in SE-ResNet9) becomes a broadcast product summed over the
input features. Inductor lowers a matmul to a cuBLAS kernel of its own, into which nothing fuses;
as a reduction it is a Triton kernel into which the bias, the ReLU or sigmoid after it, and their
neighbours fuse (measurements: docs/decisions.md, "Small linear layers as reductions")."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import is_call

__all__ = ["small_linears_as_reductions", "linear_parts", "graph_value", "value_of", "MAX_WEIGHT",
           "MAX_MACS"]

MAX_WEIGHT = 16384
"""Largest weight (in elements) rewritten: SE-ResNet9's largest SE layer is 512x32."""
MAX_MACS = 1 << 24
"""Largest product rows x in x out rewritten (multiply-accumulates): beyond, a GEMM's tensor cores
win over a reduction's FMAs."""
def linear_parts(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, object, object] | None:
    """``(input, weight, bias)`` of a linear layer call (``bias`` may be ``None``): an
    ``nn.Linear`` module (``weight``/``bias`` are then attribute paths) or ``F.linear``."""
    if node.op == "call_module" and type(gm.get_submodule(node.target)) is torch.nn.Linear:
        module = gm.get_submodule(node.target)
        bias = f"{node.target}.bias" if module.bias is not None else None
        return node.args[0], f"{node.target}.weight", bias
    if is_call(node, F.linear):
        args = [*node.args, *([None] * 3)][:3]
        return args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    return None


def value_of(gm: fx.GraphModule, arg: object) -> torch.Tensor | None:
    """The tensor (or its metadata) behind a graph value: an attribute path's tensor, a node's
    ``meta["val"]``; ``None`` when unknown."""
    if isinstance(arg, str):
        return operator.attrgetter(arg)(gm)
    val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def graph_value(graph: fx.Graph, arg: object) -> object:
    """``arg`` as a value of ``graph``: an attribute path becomes a ``get_attr`` node."""
    return graph.get_attr(arg) if isinstance(arg, str) else arg


def small_linears_as_reductions(gm: fx.GraphModule) -> int:
    """Rewrite, in place, each linear layer ``y = x @ W.T + b`` (``x``: (..., K), ``W``: (O, K))
    whose weight has at most :data:`MAX_WEIGHT` elements and whose rows x K x O is at most
    :data:`MAX_MACS` as ``sum(x[..., :, None] * W.T, dim=-2) + b``: the same sum in another
    order (Inductor accumulates fp16 and bf16 in fp32, as cuBLAS does). Layers whose input has no
    shape metadata (``meta["val"]``) stay. Returns how many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        parts = linear_parts(gm, node)
        if parts is None:
            continue
        x, weight, bias = parts
        val, w_val = value_of(gm, x), value_of(gm, weight)
        if val is None or w_val is None or w_val.dim() != 2 or val.dim() < 1:
            continue
        out_features, in_features = w_val.shape
        rows = val.numel() // max(in_features, 1)
        if w_val.numel() > MAX_WEIGHT or rows * in_features * out_features > MAX_MACS:
            continue
        graph = gm.graph
        with graph.inserting_before(node):
            w, b = graph_value(graph, weight), graph_value(graph, bias)
            product = graph.call_function(torch.mul, (graph.call_method("unsqueeze", (x, -1)),
                                                      graph.call_method("t", (w,))))
            out = graph.call_function(torch.sum, (product, -2))
            if b is not None:
                out = graph.call_function(torch.add, (out, b))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
