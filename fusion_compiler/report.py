"""Reports on a compiled graph: the region table, the convolutions and ops left to PyTorch with
their reasons, and the whole dump (graphs per stage, regions, cuDNN graph JSON) as text or JSON."""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch
import torch.fx as fx
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .backends.autotune import fastest
from .ops import is_call
from .region import Region

__all__ = ["format_regions", "format_tuning", "format_gradients", "unfused_convolutions", "pytorch_nodes", "dump", "format_text",
           "DEFAULT_STAGES"]

DEFAULT_STAGES = ("captured", "fused", "lowered")
_CONV_FUNCS = {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
               torch.conv_transpose2d, torch.conv_transpose3d}
# data movement and bookkeeping that is not worth a line in the "left to PyTorch" table
_QUIET = {"getitem", "getattr", "reshape", "view", "size", "contiguous", "expand", "permute",
          "flatten", "neg", "rsqrt"}


def _render(table: Table) -> str:
    buf = io.StringIO()
    Console(file=buf, width=160, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()


def _add_row(table: Table, *cells: str) -> None:
    """Add plain-text cells (no rich markup: patterns contain brackets)."""
    table.add_row(*(Text(str(c)) for c in cells))


def _target_name(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__
    return getattr(node.target, "__name__", str(node.target))


def unfused_convolutions(gm: fx.GraphModule) -> list[dict]:
    """Convolutions of the top-level graph that no region absorbed: ``{"node", "op", "reason"}``."""
    reasons = gm.meta.get("fusion_reasons", {})
    result = []
    for node in gm.graph.nodes:
        is_conv_module = node.op == "call_module" and isinstance(
            gm.get_submodule(node.target), torch.nn.modules.conv._ConvNd)
        if is_call(node, *_CONV_FUNCS) or is_conv_module:
            reason = reasons.get(node.name) or (
                f"{_target_name(node, gm)}: only 2-d, zero-padded convolutions are fused")
            result.append({"node": node.name, "op": _target_name(node, gm), "reason": reason})
    return result


def pytorch_nodes(gm: fx.GraphModule) -> list[dict]:
    """Compute nodes left to PyTorch (outside every region), each with the fuse pass's reason."""
    reasons = gm.meta.get("fusion_reasons", {})
    result = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), Region):
            continue
        name = _target_name(node, gm)
        if name in _QUIET and node.name not in reasons:
            continue
        reason = reasons.get(node.name, "not part of a convolution chain")
        result.append({"node": node.name, "op": name, "reason": reason})
    return result


def format_regions(regions: Sequence[Region]) -> str:
    """The region table (id, pattern, absorbed nodes, backend, status, reason or plan, workspace)."""
    return _regions_table([r.describe() for r in regions])


def _regions_table(rows: list[dict]) -> str:
    table = Table(title=f"{len(rows)} fused regions")
    for col in ("id", "pattern", "nodes", "backend", "status", "reason / plan", "workspace"):
        table.add_column(col, overflow="fold")
    for r in rows:
        ws = "" if r["workspace_bytes"] is None else f"{r['workspace_bytes']} B"
        _add_row(table, r["id"], r["pattern"], ", ".join(r["nodes"]), r["backend"], r["status"],
                 r["reason"] or r["plan"], ws)
    return _render(table)


def format_tuning(regions: Sequence[Region]) -> str:
    """Per region, what autotuning measured (ms per execution, median of CUDA-graph timings on
    random data): plans timed, heuristics' first plan and the chosen one, seconds spent building
    plans, and the lowered kernel (input preparation included) against the region's PyTorch ops."""
    table = Table(title="autotuning (cuDNN execution plans per region)")
    for col in ("id", "pattern", "plans timed", "first plan ms", "chosen plan", "chosen ms",
                "build s", "kernel ms", "PyTorch ms", "backend"):
        table.add_column(col, overflow="fold")
    for r in regions:
        timed = [t for t in r.tuning if t.ms is not None]
        best = fastest(r.tuning)
        if best is None and not r.timing:
            continue
        _add_row(table, r.region_id, r.pattern, f"{len(timed)}/{len(r.tuning)}",
                 f"{timed[0].ms:.4f}" if timed else "", f"#{best.index} {best.name}" if best else "",
                 f"{best.ms:.4f}" if best else "", f"{sum(t.build_s for t in r.tuning):.1f}",
                 *(f"{r.timing[k]:.4f}" if k in r.timing else "" for k in ("cudnn_ms", "pytorch_ms")),
                 r.backend)
    return _render(table)


def format_gradients(regions: Sequence[Region]) -> str:
    """Per region of a training specialization, how its backward runs: dgrad (``dgrad_drelu``
    when fused with the producing region's ReLU backward) and wgrad each on cuDNN or PyTorch,
    with their times when autotuning measured them (ms per call, CUDA-graph timing on random
    data), the reason for every piece left to PyTorch and, for a cuDNN dgrad, why the ReLU
    backward is not in it. Regions whose forward runs on PyTorch are differentiated by PyTorch
    autograd (the region's reason says why)."""
    table = Table(title="backward per region (dgrad, wgrad)")
    for col in ("id", "pattern", "piece", "backend", "cuDNN ms", "PyTorch ms", "reason"):
        table.add_column(col, overflow="fold")
    for r in regions:
        if not r.gradients:
            _add_row(table, r.region_id, r.pattern, "all", "PyTorch autograd", "", "",
                     r.reason or "region runs on the reference backend")
            continue
        for p in r.gradients:
            _add_row(table, r.region_id, r.pattern, p.kind, p.backend,
                     "" if p.cudnn_ms is None else f"{p.cudnn_ms:.5f}",
                     "" if p.pytorch_ms is None else f"{p.pytorch_ms:.5f}", p.reason or p.note)
    return _render(table)


def _format_left(rows: list[dict], title: str) -> str:
    if not rows:
        return f"{title}: none\n"
    table = Table()
    for col in ("node", "op", "reason"):
        table.add_column(col, overflow="fold")
    for row in rows:
        _add_row(table, row["node"], row["op"], row["reason"])
    return f"{title}:\n" + _render(table)


def dump(model: torch.nn.Module, inputs: Sequence[Any], *, backend: str = "auto",
         stages: Sequence[str] = DEFAULT_STAGES, **options: Any) -> dict:
    """Compile ``model`` for ``inputs`` (under ``torch.no_grad``) and describe the result.

    ``options`` are :func:`fusion_compiler.compile`'s (``cache_dir``, ``autotune``,
    ``fuse_prologue``, ``fuse_reduction``). Nothing runs: the specialization is compiled without a
    CUDA graph and without a glue backend (both only change how the graph is called).

    Returns a JSON-ready dict: ``inputs``, ``stages`` (stage name -> Python code of the graph;
    ``captured``, a pass name such as ``normalize``, ``fused`` or ``lowered``), ``regions`` (see
    :meth:`Region.describe`), ``unfused`` (convolutions outside every region, with reasons) and
    ``pytorch`` (other ops left to PyTorch, with reasons).
    """
    from .compiler import CompiledModule  # noqa: PLC0415  (compiler imports this module lazily)

    compiled = CompiledModule(model, backend=backend, **{"cuda_graph": False, "glue_backend": None,
                                                         **options})
    with torch.no_grad():
        spec = compiled.specialize(*inputs)
    gm = spec.graph_module
    codes = dict(spec.stages)
    codes["fused"] = codes.get("verify", codes.get("fuse", ""))
    for region in spec.regions:
        codes["fused"] += f"\n# region {region.region_id}: {region.pattern}\n{region.graph_module.code}"
    codes["lowered"] = gm.code
    unknown = [s for s in stages if s not in codes]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; choose from {sorted(codes)}")
    return {
        "inputs": [str(a) for a in spec.signature[0]],
        "stages": {s: codes[s] for s in stages},
        "regions": [r.describe() for r in spec.regions],
        "unfused": unfused_convolutions(gm),
        "pytorch": pytorch_nodes(gm),
    }


def format_text(report: dict, title: str = "") -> str:
    """Human-readable form of :func:`dump`'s result: graphs per stage, then the tables."""
    out = []
    if title:
        out.append(f"# {title}  inputs: {', '.join(report['inputs'])}\n")
    for stage, code in report["stages"].items():
        out.append(f"=== {stage} graph ===\n{code.strip()}\n")
    out.append(_regions_table(report["regions"]))
    out.append(_format_left(report["unfused"], "convolutions not fused"))
    out.append(_format_left(report["pytorch"], "ops left to PyTorch"))
    return "\n".join(out)
