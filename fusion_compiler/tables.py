"""The region tables a compiled module prints (``CompiledModule.report()``,
``compile(report=True)``) and the tools reuse: per region its pattern, backend and plan; what
autotuning measured; how a training region's backward runs. Plain text, at most
:data:`WIDTH` columns wide."""

from __future__ import annotations

import io
from typing import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .backends.cudnn.autotune import fastest
from .ir.ops import conv_flops
from .ir.region import Region

__all__ = ["format_regions", "format_tuning", "format_gradients", "regions_table", "render",
           "add_row", "WIDTH"]

WIDTH = 160
"""Columns the tables are rendered in."""


def render(table: Table) -> str:
    buf = io.StringIO()
    Console(file=buf, width=WIDTH, force_terminal=False, color_system=None).print(table)
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
        side = "; on the side stream" if r.get("stream") == "side" else ""
        add_row(table, r["id"], r["pattern"], ", ".join(r["nodes"]), r["backend"], r["status"],
                 (r["reason"] or r["plan"]) + side, ws)
    return render(table)


def format_tuning(regions: Sequence[Region]) -> str:
    """Per region, what autotuning measured (ms per execution, median of CUDA-graph timings on
    random data): plans timed, heuristics' first plan and the chosen one, the chosen plan's
    convolution TFLOP/s (:func:`conv_flops` over its time), seconds spent building plans, each
    candidate backend's kernel timed against the others (input preparation included; ``PyTorch``:
    the region's own ops) and the backend that runs it."""
    table = Table(title="autotuning (execution plans and candidate backends per region)")
    for col in ("id", "pattern", "plans timed", "first plan ms", "chosen plan", "chosen ms",
                "TFLOP/s", "build s", "candidates, ms", "backend"):
        table.add_column(col, overflow="fold")
    for r in regions:
        timed = [t for t in r.tuning if t.ms is not None]
        best = fastest(r.tuning)
        if best is None and not r.timing:
            continue
        flops = conv_flops(r.conv, r.graph_module)
        candidates = ", ".join(f"{'PyTorch' if name == 'reference' else name} {ms:.4f}"
                               for name, ms in r.timing.items())
        add_row(table, r.region_id, r.pattern, f"{len(timed)}/{len(r.tuning)}",
                 f"{timed[0].ms:.4f}" if timed else "", f"#{best.index} {best.name}" if best else "",
                 f"{best.ms:.4f}" if best else "",
                 f"{flops / best.ms / 1e9:.1f}" if best and best.ms > 0 and flops else "",
                 f"{sum(t.build_s for t in r.tuning):.1f}", candidates, r.backend)
    return render(table)


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
    return render(table)
