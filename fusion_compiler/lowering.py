"""Lowering: give every region of a fused graph a kernel from a backend.

``backend="auto"`` tries cuDNN and falls back to the reference backend with cuDNN's reason;
``"cudnn"`` does the same but logs each fallback as a warning; ``"reference"`` uses torch ops
everywhere. Every region also gets its cuDNN graph JSON (``region.cudnn_graph``) when the frontend
is importable, GPU or not, so dumps show what would run.
"""

from __future__ import annotations

import logging

import torch.fx as fx
from tqdm.auto import tqdm

from .backends import get_backend
from .backends.cudnn_graph import graph_json
from .errors import UnsupportedError, condense
from .region import Region

__all__ = ["lower", "regions_of", "BACKEND_CHOICES"]

log = logging.getLogger("fusion_compiler")
BACKEND_CHOICES = ("auto", "cudnn", "reference")


def regions_of(gm: fx.GraphModule) -> list[Region]:
    """The regions of a fused graph, in graph order."""
    return [gm.get_submodule(n.target) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Region)]


def lower(gm: fx.GraphModule, backend: str = "auto", progress: bool | None = None,
          **backend_options) -> fx.GraphModule:
    """Choose and build a kernel for every region of ``gm`` (in place); return ``gm``.

    Args:
        backend: ``"auto"``, ``"cudnn"`` or ``"reference"``.
        progress: show a progress bar while kernels build (``None``: only on a terminal).
        backend_options: passed to the cuDNN backend (``cache_dir``, ``autotune``).

    Raises:
        ValueError: unknown ``backend``.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    reference = get_backend("reference")
    preferred = reference if backend == "reference" else get_backend("cudnn", **backend_options)
    regions = regions_of(gm)
    bar = tqdm(regions, desc="fusion_compiler: lowering regions", unit="region",
               disable=(not progress) if progress is not None else None, leave=False)
    for region in bar:
        try:
            region.cudnn_graph = graph_json(region)
        except UnsupportedError:
            region.cudnn_graph = None  # the cuDNN backend reports the same problem below
        support = preferred.supports(region)
        chosen, reason = preferred, support.reason
        if support:
            try:
                region.set_kernel(preferred.lower(region))
            except UnsupportedError as exc:
                chosen, reason = reference, exc.reason
        else:
            chosen = reference
        if chosen is reference:
            region.set_kernel(reference.lower(region))
        region.backend = chosen.name
        region.status = "lowered" if chosen is preferred else "fallback"
        region.reason = condense(reason) if chosen is not preferred else ""
        if region.status == "fallback":
            level = logging.WARNING if backend == "cudnn" else logging.INFO
            log.log(level, "region %s (%s) runs on the reference backend: %s",
                    region.region_id, region.pattern, region.reason)
    return gm
