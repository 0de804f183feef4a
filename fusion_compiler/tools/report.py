"""Reports on a compiled graph: a coverage summary (convolutions and FLOPs in regions, regions per
backend), the region table, the convolutions and ops left to PyTorch with their reasons, and the
whole dump (summary, tables, graphs per stage, cuDNN graph JSON) as text or JSON."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Sequence

import torch
import torch.fx as fx
from rich.table import Table

from ..ir.ops import conv_flops, is_call
from ..ir.region import called_region
from ..passes import pass_names
from ..tables import (add_row, format_gradients, format_regions, format_tuning, regions_table,
                      render)

__all__ = ["format_regions", "format_tuning", "format_gradients", "unfused_convolutions",
           "pytorch_nodes", "op_name_of", "conv_flops", "summarize", "describe",
           "group_by_reason", "format_summary", "format_text", "DEFAULT_STAGES", "STAGES_HELP"]

DEFAULT_STAGES: tuple[str, ...] = ()  # graph code only when asked for
STAGES_HELP = ", ".join(["captured", *(n for names in pass_names().values() for n in names),
                         "fused", "lowered"])
"""The stages ``describe`` knows: the captured graph, the graph after any pass (where it ran),
``fused`` (after the fusion pipeline, with every region's own graph) and ``lowered`` (what
runs)."""
_CONV_FUNCS = {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
               torch.conv_transpose2d, torch.conv_transpose3d}
# data movement and bookkeeping that is not worth a line in the "left to PyTorch" table
_QUIET = {"getitem", "getattr", "reshape", "view", "size", "contiguous", "expand", "permute",
          "flatten", "neg", "rsqrt", "join_side_stream.default"}  # the last: runtime.streams


def op_name_of(node: fx.Node, gm: fx.GraphModule) -> str:
    """What a node of ``gm`` calls: a module's class name, else the function or method name."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target))


def unfused_convolutions(gm: fx.GraphModule) -> list[dict]:
    """Convolutions of the top-level graph that no region absorbed: ``{"node", "op", "reason"}``."""
    reasons = gm.meta.get("fusion_reasons", {})
    result = []
    for node in gm.graph.nodes:
        if _is_conv_node(node, gm):
            reason = reasons.get(node.name) or (
                f"{op_name_of(node, gm)}: only 2-d, zero-padded convolutions are fused")
            result.append({"node": node.name, "op": op_name_of(node, gm), "reason": reason})
    return result


def pytorch_nodes(gm: fx.GraphModule) -> list[dict]:
    """Compute nodes left to PyTorch (outside every region), each with the fuse pass's reason."""
    reasons = gm.meta.get("fusion_reasons", {})
    result = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if called_region(gm, node) is not None:
            continue
        name = op_name_of(node, gm)
        if name in _QUIET and node.name not in reasons:
            continue
        reason = reasons.get(node.name, "not part of a convolution chain")
        result.append({"node": node.name, "op": name, "reason": reason})
    return result


def _format_left(rows: list[dict], title: str) -> str:
    if not rows:
        return f"{title}: none\n"
    table = Table()
    for col in ("node", "op", "reason"):
        table.add_column(col, overflow="fold")
    for row in rows:
        add_row(table, row["node"], row["op"], row["reason"])
    return f"{title}:\n" + render(table)


def summarize(spec: Any) -> dict:
    """Coverage of a specialization: convolutions in regions of all, their share of convolution
    FLOPs (all regions, and those lowered to cuDNN), regions per backend, kinds of fallback
    reasons with their counts (the region table has each region's whole reason). JSON-ready;
    FLOPs are counted from traced shapes (:func:`conv_flops`)."""
    gm = spec.graph_module
    regions = spec.regions
    unfused = [n for n in gm.graph.nodes if _is_conv_node(n, gm)]
    region_flops = [(r, conv_flops(r.conv, r.graph_module)) for r in regions]
    total = sum(f or 0 for _, f in region_flops) + sum(conv_flops(n, gm) or 0 for n in unfused)
    cudnn = sum(f or 0 for r, f in region_flops if r.backend == "cudnn")
    fused = sum(f or 0 for _, f in region_flops)
    return {
        "convolutions": len(regions) + len(unfused),
        "convolutions_in_regions": len(regions),
        "conv_gflop": total / 1e9,
        "conv_flops_in_regions": fused / total if total else None,
        "conv_flops_on_cudnn": cudnn / total if total else None,
        "regions_per_backend": dict(Counter(r.backend for r in regions)),
        "fallback_reasons": dict(Counter(_reason_kind(r.reason) for r in regions
                                         if r.status == "fallback")),
    }


def _reason_kind(reason: str) -> str:
    """A fallback reason without its particulars, to count alike ones together: the text before
    the first ``": "`` (the times, cuDNN's message), a leading channel count as ``K``."""
    return re.sub(r"^\d+ output channels", "K output channels", reason.split(": ", 1)[0])


def _is_conv_node(node: fx.Node, gm: fx.GraphModule) -> bool:
    return is_call(node, *_CONV_FUNCS) or (node.op == "call_module" and isinstance(
        gm.get_submodule(node.target), torch.nn.modules.conv._ConvNd))


def describe(spec: Any, stages: Sequence[str] = DEFAULT_STAGES) -> dict:
    """A JSON-ready description of a specialization (``CompiledModule.specialize``'s result,
    :func:`fusion_compiler.tools.dump.specialize_for_dump`'s): ``inputs``, ``summary``
    (:func:`summarize`), ``stages`` (stage name -> Python code of the graph: ``captured``, a pass
    name such as ``normalize``, ``fused`` (with every region's own graph) or ``lowered``),
    ``regions`` (see :meth:`~fusion_compiler.ir.region.Region.describe`), ``unfused`` (convolutions
    outside every region, with reasons) and ``pytorch`` (other ops left to PyTorch, with reasons).

    Raises:
        ValueError: a stage name that does not exist (the message lists those that do).
    """
    gm = spec.graph_module
    codes = dict(spec.stages)
    codes["fused"] = next((codes[n] for n in reversed(pass_names()["fusion"]) if n in codes), "")
    for region in spec.regions:
        codes["fused"] += f"\n# region {region.region_id}: {region.pattern}\n{region.graph_module.code}"
    codes["lowered"] = gm.code
    unknown = [s for s in stages if s not in codes]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; choose from {sorted(codes)}")
    return {
        "inputs": [str(a) for a in spec.signature[0]],
        "summary": summarize(spec),
        "stages": {s: codes[s] for s in stages},
        "regions": [r.describe() for r in spec.regions],
        "unfused": unfused_convolutions(gm),
        "pytorch": pytorch_nodes(gm),
    }


_REGION_REASON = re.compile(r"^not fused into the region of \S+: ")


def group_by_reason(rows: Sequence[dict]) -> list[dict]:
    """Rows of :func:`pytorch_nodes` grouped by reason, most ops first: ``{"reason", "count",
    "ops"`` (op name -> count) ``, "nodes"}``. ``"not fused into the region of conv2d_14: why"``
    and the same for other convolutions group under ``"not fused into a region: why"``."""
    groups: dict[str, dict] = {}
    for row in rows:
        reason = _REGION_REASON.sub("not fused into a region: ", row["reason"])
        group = groups.setdefault(reason, {"reason": reason, "count": 0, "ops": Counter(),
                                           "nodes": []})
        group["count"] += 1
        group["ops"][row["op"]] += 1
        group["nodes"].append(row["node"])
    return sorted(({**g, "ops": dict(g["ops"])} for g in groups.values()),
                  key=lambda g: -g["count"])


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def format_summary(report: dict, title: str = "") -> str:
    """The header of a dump: model, inputs, device; convolutions fused of all and their share of
    convolution FLOPs (in regions, on cuDNN); regions per backend with fallback reasons."""
    s = report["summary"]
    backends = ", ".join(f"{b} {n}" for b, n in sorted(s["regions_per_backend"].items()))
    lines = [f"# {title}" if title else "#",
             f"inputs:         {', '.join(report['inputs'])}",
             f"convolutions:   {s['convolutions_in_regions']} of {s['convolutions']} in fused "
             f"regions ({_percent(s['conv_flops_in_regions'])} of {s['conv_gflop']:.2f} GFLOP); "
             f"{_percent(s['conv_flops_on_cudnn'])} of the FLOPs on cuDNN",
             f"regions:        {sum(s['regions_per_backend'].values())} ({backends or 'none'})"]
    for reason, count in s["fallback_reasons"].items():
        lines.append(f"  fallback x{count}: {reason}")
    left = report["pytorch"]
    lines.append(f"left to PyTorch: {len(report['unfused'])} convolution(s), {len(left)} other "
                 f"op(s) in {len(group_by_reason(left))} group(s) (below)")
    return "\n".join(lines) + "\n"


def _format_groups(rows: list[dict], title: str, shown: int = 6) -> str:
    if not rows:
        return f"{title}: none\n"
    table = Table(title=title)
    for col in ("ops", "reason", "nodes"):
        table.add_column(col, overflow="fold")
    for g in group_by_reason(rows):
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(g["ops"].items(), key=lambda kv: -kv[1]))
        more = f" ... (+{len(g['nodes']) - shown})" if len(g["nodes"]) > shown else ""
        add_row(table, f"{g['count']}: {ops}", g["reason"], ", ".join(g["nodes"][:shown]) + more)
    return render(table)


def format_text(report: dict, title: str = "") -> str:
    """Human-readable form of :func:`describe`'s result, summary first: the header
    (:func:`format_summary`), the region table, the convolutions not fused, the other ops left to
    PyTorch grouped by reason, then the graph code of each stage asked for."""
    out = [format_summary(report, title), regions_table(report["regions"]),
           _format_left(report["unfused"], "convolutions not fused"),
           _format_groups(report["pytorch"], "ops left to PyTorch, by reason")]
    for stage, code in report["stages"].items():
        out.append(f"=== {stage} graph ===\n{code.strip()}\n")
    return "\n".join(out)
