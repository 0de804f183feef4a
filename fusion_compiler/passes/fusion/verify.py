"""verify: check the cuDNN graph rules on a fused graph before it is lowered.

Rules (docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"; cuDNN frontend graph API: every
tensor has one producer, convolutions compute ``y = alpha * conv(x, w) + beta * y`` and are only
supported with ``alpha = 1, beta = 0``):

* no in-place node anywhere in the graph (every value is written once: SSA);
* each region holds exactly one convolution, whose ``bias`` is ``None`` and which has no ``out=``
  (beta = 0: accumulation must be an explicit ``add`` node);
* a region's reduction is an exit: nothing inside the region reads it;
* every op inside a region is one of the canonical ops of :mod:`fusion_compiler.ir.ops`;
* no region output aliases a region input, and no value is returned twice.

Violations raise :class:`~fusion_compiler.ir.errors.FusionError` naming the node.
"""

from __future__ import annotations

import torch.fx as fx

from ...ir.errors import FusionError
from ...ir.ops import is_conv, is_hw_sum, is_pointwise
from ...ir.region import Region, called_region
from ..pre_fusion.normalize import inplace_target

__all__ = ["verify"]

_VIEW_METHODS = {"view", "reshape", "expand", "permute", "transpose", "contiguous", "squeeze",
                 "unsqueeze", "flatten", "as_strided", "detach"}


def verify(gm: fx.GraphModule) -> fx.GraphModule:
    """Raise :class:`FusionError` on the first rule violation (see module doc); return ``gm``.
    A graph that keeps its in-place ops (``gm.meta["fusion_off"]``, see
    :func:`~fusion_compiler.passes.pre_fusion.functionalize.functionalize`) has no region and runs
    as PyTorch ops: nothing to check."""
    if gm.meta.get("fusion_off"):
        return gm
    _check_ssa(gm, where="graph")
    for node in gm.graph.nodes:
        if (region := called_region(gm, node)) is not None:
            _check_region(region, node.name)
    return gm


def _check_ssa(gm: fx.GraphModule, where: str) -> None:
    for node in gm.graph.nodes:
        if inplace_target(gm, node) is not None:
            raise FusionError(f"in-place op {node.target} in the {where}: every value must be "
                              "written once (SSA)", node.name)


def _check_region(region: Region, where: str) -> None:
    sub = region.graph_module
    _check_ssa(sub, where=f"region {region.region_id}")
    convs = [n for n in sub.graph.nodes if is_conv(n)]
    if len(convs) != 1:
        raise FusionError(f"region {region.region_id} holds {len(convs)} convolutions, cuDNN "
                          "graphs take exactly one", where)
    conv = convs[0]
    if conv.args[2] is not None or "out" in conv.kwargs:
        raise FusionError("convolution accumulates into its output (bias/out given): beta must "
                          "be 0, write the accumulation as an explicit add node", conv.name)
    placeholders = {n for n in sub.graph.nodes if n.op == "placeholder"}
    for node in sub.graph.nodes:
        if node.op in ("placeholder", "output") or node is conv:
            continue
        if not (is_pointwise(node) or is_hw_sum(node)):
            raise FusionError(f"{node.op} {node.target} is not an op a region may hold", node.name)
        if is_hw_sum(node) and any(u.op != "output" for u in node.users):
            raise FusionError("reduction is read inside its region: it must be an exit node",
                              node.name)
    outputs = region.output_nodes
    seen = set()
    for out in outputs:
        src = out
        while isinstance(src, fx.Node) and src.op == "call_method" and src.target in _VIEW_METHODS:
            src = src.args[0]
        if src in placeholders:
            raise FusionError(f"region {region.region_id} output aliases its input {src.name}",
                              getattr(out, "name", str(out)))
        if out in seen:
            raise FusionError(f"region {region.region_id} returns {out.name} twice", out.name)
        seen.add(out)
