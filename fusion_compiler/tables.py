"""What a compiled module reports (``CompiledModule.report()``) and the tools reuse: the coverage
summary (convolutions and FLOPs in regions, regions per backend), the region table (pattern,
backend, plan or reason), what autotuning measured, how a training region's backward runs, the
ops left to PyTorch with their reasons. Plain text, tables at most
:data:`WIDTH` columns wide, their cells wrapped."""

from __future__ import annotations

import io
import operator
import re
from collections import Counter
from typing import Any, Sequence

import torch.fx as fx

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .backends.cudnn.autotune import fastest
from .ir.ops import conv_flops, is_any_conv
from .ir.region import Region, called_region, channel_view_total

__all__ = ["coverage", "format_report", "format_regions", "format_tuning", "format_gradients",
           "format_summary", "format_left", "format_groups", "regions_table", "summarize",
           "unfused_convolutions", "pytorch_nodes", "group_by_reason", "op_name_of", "render",
           "add_row", "WIDTH", "WIDE", "NO_CUDA"]

WIDTH = 100
"""Columns the tables are rendered in (cells wrap to fit)."""
WIDE = 160
"""Columns of the benchmark's tables (autotuning, backward), which go to logs and files."""
NO_CUDA = "CUDA is not available on this machine"
"""The reason every region gives on a machine without CUDA (the cuDNN backend's)."""

# data movement and bookkeeping that is not worth a line in the "left to PyTorch" table
_QUIET = {"getitem", "getattr", "reshape", "view", "size", "contiguous", "expand", "permute",
          "flatten", "neg", "rsqrt"}



def render(table: Table, width: int = WIDTH) -> str:
    """``table`` as plain text at most ``width`` columns wide (cells wrap)."""
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()


def add_row(table: Table, *cells: str) -> None:
    """Add plain-text cells (no rich markup: patterns contain brackets)."""
    table.add_row(*(Text(str(c)) for c in cells))


def format_regions(regions: Sequence[Region]) -> str:
    """The region table (id, pattern, absorbed nodes, backend, status, reason or plan, workspace)."""
    return regions_table([r.describe() for r in regions])


def regions_table(rows: list[dict]) -> str:
    table = Table(title=f"{len(rows)} fused regions")
    for col in ("id", "pattern", "nodes", "backend", "status", "reason / plan", "workspace"):
        table.add_column(col, overflow="fold")
    for r in rows:
        ws = "" if r["workspace_bytes"] is None else f"{r['workspace_bytes']} B"
        add_row(table, r["id"], r["pattern"], ", ".join(r["nodes"]), r["backend"], r["status"],
                 r["reason"] or r["plan"], ws)
    return render(table)


def format_tuning(regions: Sequence[Region]) -> str:
    """Per region, what autotuning measured (ms per execution, median of CUDA-graph timings on
    random data): plans timed, heuristics' first plan and the chosen one, the chosen plan's
    convolution TFLOP/s (:func:`conv_flops` over its time), seconds spent building plans, each
    candidate backend's kernel timed against the others (ms and convolution TFLOP/s; input
    preparation included; ``PyTorch``: the region's own ops) and the backend that runs it."""
    table = Table(title="autotuning (execution plans and candidate backends per region)")
    for col in ("id", "pattern", "plans timed", "first plan ms", "chosen plan", "chosen ms",
                "TFLOP/s", "build s", "candidates, ms (TFLOP/s)", "backend"):
        table.add_column(col, overflow="fold")
    for r in regions:
        timed = [t for t in r.tuning if t.ms is not None]
        best = fastest(r.tuning)
        if best is None and not r.timing:
            continue
        flops = conv_flops(r.conv, r.graph_module)
        candidates = ", ".join(
            f"{'PyTorch' if name == 'reference' else name} {ms:.4f}"
            + (f" ({flops / ms / 1e9:.1f})" if flops and ms > 0 else "")
            for name, ms in r.timing.items())
        add_row(table, r.region_id, r.pattern, f"{len(timed)}/{len(r.tuning)}",
                 f"{timed[0].ms:.4f}" if timed else "", f"#{best.index} {best.name}" if best else "",
                 f"{best.ms:.4f}" if best else "",
                 f"{flops / best.ms / 1e9:.1f}" if best and best.ms > 0 and flops else "",
                 f"{sum(t.build_s for t in r.tuning):.1f}", candidates, r.backend)
    return render(table, WIDE)


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
            add_row(table, r.region_id, r.pattern, "all", "PyTorch autograd", "", "",
                     r.reason or "region runs on the reference backend")
            continue
        for p in r.gradients:
            add_row(table, r.region_id, r.pattern, p.kind, p.backend,
                     "" if p.cudnn_ms is None else f"{p.cudnn_ms:.5f}",
                     "" if p.pytorch_ms is None else f"{p.pytorch_ms:.5f}", p.reason or p.note)
    return render(table, WIDE)


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
        if is_any_conv(node, gm):
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
        if (name in _QUIET and node.name not in reasons) or _is_glue_kernel(node) \
                or channel_view_total(node) is not None:  # horizontal fusion's views
            continue
        reason = reasons.get(node.name, "not part of a convolution chain")
        result.append({"node": node.name, "op": name, "reason": reason})
    return result


def _is_glue_kernel(node: fx.Node) -> bool:
    """Whether ``node`` calls one of this package's kernels between regions (the
    squeeze-and-excitation kernels of :mod:`fusion_compiler.kernels.se_gate`): not left to
    PyTorch."""
    from .kernels.se_gate import LIBRARY_OPS  # noqa: PLC0415

    return node.op == "call_function" and node.target in LIBRARY_OPS


def glue_kernels(gm: fx.GraphModule) -> dict[str, int]:
    """This package's kernels between regions in ``gm``, by name, with their counts."""
    return dict(Counter(op_name_of(node, gm) for node in gm.graph.nodes
                        if _is_glue_kernel(node)))


def format_left(rows: list[dict], title: str) -> str:
    if not rows:
        return f"{title}: none\n"
    table = Table()
    for col in ("node", "op", "reason"):
        table.add_column(col, overflow="fold")
    for row in rows:
        add_row(table, row["node"], row["op"], row["reason"])
    return f"{title}:\n" + render(table)


def _view_source(view: fx.Node) -> fx.Node:
    """The region call whose output ``view`` (a horizontal-fusion ``narrow``) reads."""
    source = view.args[0]
    return source.args[0] if source.target is operator.getitem else source


def summarize(spec: Any) -> dict:
    """Coverage of a specialization: convolutions in regions of all, their share of convolution
    FLOPs (all regions, and those lowered to cuDNN), regions per backend, kinds of fallback
    reasons with their counts (the region table has each region's whole reason), and how many of
    the model's convolutions horizontal fusion merged into how many. JSON-ready;
    FLOPs are counted from traced shapes (:func:`conv_flops`)."""
    gm = spec.graph_module
    regions = spec.regions
    unfused = [n for n in gm.graph.nodes if is_any_conv(n, gm)]
    region_flops = [(r, conv_flops(r.conv, r.graph_module)) for r in regions]
    total = sum(f or 0 for _, f in region_flops) + sum(conv_flops(n, gm) or 0 for n in unfused)
    cudnn = sum(f or 0 for r, f in region_flops if r.backend == "cudnn")
    fused = sum(f or 0 for _, f in region_flops)
    views = [n for n in gm.graph.nodes if channel_view_total(n) is not None]
    merged = len({_view_source(n) for n in views})
    return {
        # convolutions of the model merged by horizontal fusion count once per merged one
        "horizontally_fused": len(views),
        "horizontally_fused_into": merged,
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
    """The header of a dump or report: model, inputs, device; convolutions fused of all and their
    share of convolution FLOPs (in regions, on cuDNN); regions per backend with fallback reasons.
    Where every region fell back because the machine has no CUDA, it says so once, as what runs
    here, not as a failure."""
    s = report["summary"]
    count = sum(s["regions_per_backend"].values())
    backends = ", ".join(f"{b} {n}" for b, n in sorted(s["regions_per_backend"].items()))
    no_cuda = count and s["fallback_reasons"] == {NO_CUDA: count}
    cudnn = "" if no_cuda else f"; {_percent(s['conv_flops_on_cudnn'])} of the FLOPs on cuDNN"
    lines = [f"# {title}" if title else "#",
             f"inputs:         {', '.join(report['inputs'])}",
             f"convolutions:   {s['convolutions_in_regions']} of {s['convolutions']} in fused "
             f"regions ({_percent(s['conv_flops_in_regions'])} of {s['conv_gflop']:.2f} "
             f"GFLOP){cudnn}"]
    if s.get("horizontally_fused"):
        lines[-1] += (f"; {s['horizontally_fused']} convolutions of the model merged into "
                      f"{s['horizontally_fused_into']} (horizontal fusion)")
    if no_cuda:
        lines.append(f"regions:        {count}, each run as its own PyTorch ops here ({NO_CUDA})")
    else:
        lines.append(f"regions:        {count} ({backends or 'none'})")
        for reason, n in s["fallback_reasons"].items():
            lines.append(f"  fallback x{n}: {reason}")
    if kernels := report.get("glue_kernels"):
        names = ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items()))
        lines.append(f"glue kernels:   {names} (this package's, between regions: the SE blocks)")
    left = report["pytorch"]
    lines.append(f"left to PyTorch: {len(report['unfused'])} convolution(s), {len(left)} other "
                 f"op(s) in {len(group_by_reason(left))} group(s) (below)")
    lines += [f"  note: {note}" for note in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def format_runs(runs: dict) -> str:
    """One line: how a specialization's calls run now (``runs`` of :func:`coverage`)."""
    if not runs["lowered"]:
        return ("runs:           tier 0, the regions as PyTorch ops while their plans build in "
                "the background\n")
    glue = runs["glue_backend"] or "eager ops"
    graph = f"a CUDA graph ({runs['cuda_graph']})" if runs["cuda_graph"] else "no CUDA graph"
    return f"runs:           lowered regions, glue by {glue}, {graph}\n"


def format_groups(rows: list[dict], title: str, shown: int = 6) -> str:
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


def coverage(spec: Any) -> dict:
    """What a specialization covers, JSON-ready: ``inputs``, ``summary`` (:func:`summarize`),
    ``regions`` (each region's :meth:`~fusion_compiler.ir.region.Region.describe`), ``unfused``
    (convolutions outside every region, with reasons), ``glue_kernels`` (this package's kernels
    between regions, :func:`glue_kernels`), ``pytorch`` (other ops left to PyTorch, with
    reasons), ``runs`` (``lowered``: past tier 0; ``glue_backend``; ``cuda_graph``) and
    ``notes`` (why a default was not taken: a failed lowering, no CUDA graph, ...)."""
    gm = spec.graph_module
    return {"inputs": [str(a) for a in spec.signature[0]], "summary": summarize(spec),
            "regions": [r.describe() for r in spec.regions],
            "unfused": unfused_convolutions(gm), "glue_kernels": glue_kernels(gm),
            "pytorch": pytorch_nodes(gm),
            "runs": {"lowered": spec.lowered, "glue_backend": spec.glue_backend,
                     "cuda_graph": spec.cuda_graph},
            "notes": list(spec.notes)}


def format_report(report: dict, title: str = "", runs: bool = False) -> str:
    """:func:`coverage`'s result as text (what ``CompiledModule.report()`` prints and the dump
    starts with): the summary (:func:`format_summary`; with ``runs``, how the calls run: tier,
    glue, CUDA graph), the region table, the convolutions not fused and the other ops left to
    PyTorch, grouped by reason."""
    summary = format_summary(report, title)
    if runs and "runs" in report:
        summary += format_runs(report["runs"])
    return "\n".join([summary, regions_table(report["regions"]),
                      format_left(report["unfused"], "convolutions not fused"),
                      format_groups(report["pytorch"], "ops left to PyTorch, by reason")])
