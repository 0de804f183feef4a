"""The dump of a compiled graph, as text or JSON: the coverage summary, the region table, the
convolutions and ops left to PyTorch with their reasons (all from :mod:`fusion_compiler.tables`),
and the graph after each stage, with each region's cuDNN graph JSON."""

from __future__ import annotations

from typing import Any, Sequence

from ..passes import pass_names
from ..tables import coverage, format_report

__all__ = ["describe", "format_text", "DEFAULT_STAGES", "STAGES_HELP"]

DEFAULT_STAGES: tuple[str, ...] = ()  # graph code only when asked for
STAGES_HELP = ", ".join(["captured", *(n for names in pass_names().values() for n in names),
                         "fused", "lowered"])
"""The stages ``describe`` knows: the captured graph, the graph after any pass (where it ran),
``fused`` (after the fusion pipeline, with every region's own graph) and ``lowered`` (what
runs)."""


def describe(spec: Any, stages: Sequence[str] = DEFAULT_STAGES) -> dict:
    """A JSON-ready description of a specialization (``CompiledModule.specialize``'s result,
    :func:`fusion_compiler.tools.dump.specialize_for_dump`'s): its
    :func:`~fusion_compiler.tables.coverage` (``inputs``, ``summary``, ``regions``, ``unfused``,
    ``pytorch``) and ``stages`` (stage name -> Python code of the graph: ``captured``, a pass
    name such as ``normalize``, ``fused`` (with every region's own graph) or ``lowered``).

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
        known = {n for names in pass_names().values() for n in names}
        absent = [s for s in unknown if s in known]
        raise ValueError(f"stage(s) {absent} did not run for this model, device and mode (a "
                         "pass runs only where it applies: see docs/architecture.md); "
                         f"choose from {sorted(codes)}" if absent == unknown else
                         f"unknown stage(s) {unknown}; choose from {sorted(codes)}")
    return {**coverage(spec), "stages": {s: codes[s] for s in stages}}


def format_text(report: dict, title: str = "") -> str:
    """Human-readable form of :func:`describe`'s result: what ``CompiledModule.report()`` prints
    (:func:`~fusion_compiler.tables.format_report`), then the graph code of each stage asked
    for."""
    out = [format_report(report, title)]
    for stage, code in report["stages"].items():
        out.append(f"=== {stage} graph ===\n{code.strip()}\n")
    return "\n".join(out)
