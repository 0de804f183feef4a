"""Lowering: give every region of a fused graph a kernel from a backend.

``backend="auto"`` tries cuDNN and falls back to the reference backend with cuDNN's reason;
``"cudnn"`` does the same but logs each fallback as a warning; ``"reference"`` uses torch ops
everywhere. When the cuDNN backend autotunes (``autotune > 1``, the default) it also times each
region against its own PyTorch ops and declines it when those are at least 10% faster (the
region's ``reason`` then says so, with both times; the timing is cached with the plan). Every
region also gets its cuDNN graph JSON (``region.cudnn_graph``) when the frontend is importable, GPU
or not, so dumps show what would run.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.fx as fx

from .backends import get_backend
from .backends.cudnn.graph import graph_json
from .autograd import plan as backward_plan
from .autograd.backward import training_region
from .ir.errors import UnsupportedError, condense
from .ir.region import Region, called_region

__all__ = ["lower", "plan_work", "PLAN_WORK", "build_plans", "regions_of",
           "BACKEND_CHOICES"]

log = logging.getLogger("fusion_compiler")
BACKEND_CHOICES = ("auto", "cudnn", "reference")


def regions_of(gm: fx.GraphModule) -> list[Region]:
    """The regions of a fused graph, in graph order."""
    return [r for n in gm.graph.nodes if (r := called_region(gm, n)) is not None]


def lower(gm: fx.GraphModule, backend: str = "auto", progress: bool | None = None, *,
          training: bool = False, derived_backward: bool = False,
          no_grad_inputs: frozenset[str] = frozenset(), **backend_options) -> fx.GraphModule:
    """Choose and build a kernel for every region of ``gm`` (in place); return ``gm``.

    Args:
        backend: ``"auto"``, ``"cudnn"`` or ``"reference"``.
        progress: show a progress bar while kernels build (``None``: only on a terminal).
        training: kernels must be differentiable. Each region is first replaced by its
            :func:`~fusion_compiler.backward.training_region` (which also returns the values its
            backward reads) and cuDNN regions get cuDNN dgrad/wgrad graphs.
        derived_backward: with ``training``, reference regions also run through the custom op
            with the derived backward (tests check it against PyTorch autograd without a GPU).
        no_grad_inputs: names of ``gm``'s placeholders whose values never need a gradient (a
            network input without ``requires_grad``): a convolution reading one, or a value
            computed from such inputs alone (the SpaceToDepth copy of the image), builds no
            dgrad.
        backend_options: passed to the cuDNN backend (``cache_dir``, ``autotune``).

    Raises:
        ValueError: unknown ``backend``.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    reference = get_backend("reference", derived_backward=derived_backward)
    preferred = reference if backend == "reference" else get_backend("cudnn", **backend_options)
    calls = [n for n in gm.graph.nodes if called_region(gm, n) is not None]
    bar = calls
    if progress or (progress is None and sys.stderr.isatty()):
        from tqdm.auto import tqdm  # noqa: PLC0415  (0.2 s of imports, only for a bar shown)

        bar = tqdm(calls, desc="fusion_compiler: building region plans", unit="region",
                   leave=False)
    grad_free = backward_plan.grad_free_nodes(gm, no_grad_inputs) if training else set()
    if training:
        for call in calls:
            region = training_region(gm.get_submodule(call.target))
            setattr(gm, call.target, region)
            region.no_grad_inputs = backward_plan.no_grad_inputs(region, call, grad_free)
        masking = backward_plan.plan_dgrad_drelu(gm)
    prefetch = getattr(preferred, "prefetch", None)
    if prefetch is not None:  # start building every region's plans at once (worker processes)
        prefetch([gm.get_submodule(call.target) for call in calls])
    for call in bar:
        region = gm.get_submodule(call.target)
        try:
            region.cudnn_graph = graph_json(region)
        except UnsupportedError:
            region.cudnn_graph = None  # the cuDNN backend reports the same problem below
        support = preferred.supports(region)
        chosen, reason = preferred, support.reason
        if support:
            try:
                region.set_kernel(preferred.lower(region, training))
            except UnsupportedError as exc:
                chosen, reason = reference, exc.reason
        else:
            chosen = reference
        if chosen is reference and preferred is not reference:
            region.set_kernel(reference.lower(region, training))
        region.backend = chosen.name
        region.status = "lowered" if chosen is preferred else "fallback"
        region.reason = condense(reason) if chosen is not preferred else ""
        if region.status == "fallback":
            level = logging.WARNING if backend == "cudnn" else logging.INFO
            log.log(level, "region %s (%s) runs on the reference backend: %s",
                    region.region_id, region.pattern, region.reason)
    if training:
        # A region whose backward is PyTorch autograd returns the unmasked gradient: only a
        # derived backward (every cuDNN region, reference ones with derived_backward) masks.
        for consumer, (producer, relu) in masking.items():
            if consumer.backend != reference.name or derived_backward:
                producer.masked_outputs.add(relu)
    return gm


PLAN_WORK = ("", "build", "tune")
"""What lowering a graph involves beyond loading cached plans, in increasing order of cost."""


def plan_work(gm: fx.GraphModule, backend: str = "auto", **backend_options) -> str:
    """The most that :func:`lower` of ``gm`` (inference) with ``backend`` has to do for one
    region's plan (:meth:`.backends.cudnn.CudnnBackend.plan_work`): ``""`` when every plan is in
    the plan cache (or no region is lowered to cuDNN), ``"build"`` when some plan must be built
    but nothing timed (CPU work in worker processes, which may run beside GPU work), ``"tune"``
    when candidate plans must also be timed on the GPU.

    Raises:
        ValueError: unknown ``backend``.
    """
    preferred = _plan_builder(backend, backend_options)
    if preferred is None:
        return ""
    return max((preferred.plan_work(r) for r in regions_of(gm)), key=PLAN_WORK.index, default="")


def build_plans(gm: fx.GraphModule, backend: str = "auto", **backend_options) -> None:
    """Build the candidate plans of ``gm``'s regions in worker processes and wait for them
    (:meth:`.backends.cudnn.CudnnBackend.prefetch`): CPU work in other processes, nothing run on
    the GPU. A later :func:`lower` of ``gm`` (inference) finds them built and only loads and
    times them. Does nothing for the ``"reference"`` backend, or without workers.

    Raises:
        ValueError: unknown ``backend``.
    """
    preferred = _plan_builder(backend, backend_options)
    if preferred is not None:
        preferred.prefetch(regions_of(gm))
        preferred.wait_for_prefetched()


def _plan_builder(backend: str, backend_options: dict) -> Any:
    """The cuDNN backend that :func:`lower` with ``backend`` prefers, or ``None`` for
    ``"reference"`` (no plans).

    Raises:
        ValueError: unknown ``backend``.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    return None if backend == "reference" else get_backend("cudnn", **backend_options)
