"""The dump of a compiled graph, as text or JSON: the coverage summary, the region table, the
convolutions and ops left to PyTorch with their reasons (all from :mod:`fusion_compiler.tables`),
and the graph after each stage, with each region's cuDNN graph JSON."""

from __future__ import annotations

from typing import Any, Sequence

from ..ir.ops import conv_flops
from ..passes import pass_names
from ..tables import (format_gradients, format_groups, format_left, format_regions,
                      format_summary, format_tuning, group_by_reason, op_name_of, pytorch_nodes,
                      regions_table, summarize, unfused_convolutions)

__all__ = ["describe", "format_text", "DEFAULT_STAGES", "STAGES_HELP", "format_regions",
           "format_tuning", "format_gradients", "format_summary", "summarize", "group_by_reason",
           "unfused_convolutions", "pytorch_nodes", "op_name_of", "conv_flops"]

DEFAULT_STAGES: tuple[str, ...] = ()  # graph code only when asked for
STAGES_HELP = ", ".join(["captured", *(n for names in pass_names().values() for n in names),
                         "fused", "lowered"])
"""The stages ``describe`` knows: the captured graph, the graph after any pass (where it ran),
``fused`` (after the fusion pipeline, with every region's own graph) and ``lowered`` (what
runs)."""


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


def format_text(report: dict, title: str = "") -> str:
    """Human-readable form of :func:`describe`'s result, summary first: the header
    (:func:`format_summary`), the region table, the convolutions not fused, the other ops left to
    PyTorch grouped by reason, then the graph code of each stage asked for."""
    out = [format_summary(report, title), regions_table(report["regions"]),
           format_left(report["unfused"], "convolutions not fused"),
           format_groups(report["pytorch"], "ops left to PyTorch, by reason")]
    for stage, code in report["stages"].items():
        out.append(f"=== {stage} graph ===\n{code.strip()}\n")
    return "\n".join(out)
