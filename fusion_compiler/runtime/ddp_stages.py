"""Where a graphed training step is cut so that DistributedDataParallel's all-reduce overlaps its
backward: stage boundaries from DDP's gradient buckets, and the graph split at them.

DDP all-reduces a bucket of gradients once every gradient in it has reached ``.grad``
(``AccumulateGrad``'s hooks). A backward replayed as one CUDA graph hands every gradient over at
its end, so no all-reduce starts before the whole backward is done. Split into stages, each with
its own pair of graphs (:class:`~fusion_compiler.runtime.cuda_graph_training.Stage`), a stage's
gradients reach DDP when that stage's backward ends, while the earlier stages' backward still runs.

DDP forms buckets in the reverse order of the parameters (the order their gradients are expected
to be ready), the first up to ``first_bucket_bytes`` (1 MiB by default), the others up to
``bucket_cap_mb``; after the first iteration it rebuilds them in the order the gradients actually
arrived, with the same caps (``torch.nn.parallel.DistributedDataParallel``'s documentation and
``_compute_bucket_assignment_by_size``). :func:`stage_boundaries` cuts the graph the same way: a
parameter's gradient is complete when the backward of its first use in the forward has run, so
walking the parameters from the last first use back, a stage starts where the bytes gathered reach
the cap.
"""

from __future__ import annotations

import bisect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

__all__ = ["ddp_bucket_caps", "stage_boundaries", "split_at"]


def ddp_bucket_caps() -> tuple[int, int] | None:
    """``(first bucket, other buckets)`` caps in bytes of the DistributedDataParallel module whose
    forward is running (``None``: no DDP forward is running, or this torch does not say)."""
    try:
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415
        ddp = DistributedDataParallel._get_active_ddp_module()
    except Exception:  # no torch.distributed in this build, or a torch without the method
        return None
    cap = getattr(ddp, "bucket_bytes_cap", None)
    if not isinstance(cap, int) or cap <= 0:
        return None
    first = getattr(getattr(ddp, "_bucket_config", None), "first_bucket_bytes_cap", None)
    if not isinstance(first, int):
        default_first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", cap)
        first = default_first if getattr(ddp, "bucket_bytes_cap_default", False) else cap
    return min(first, cap), cap


def _parameters_read(gm: fx.GraphModule, node: fx.Node) -> list[torch.nn.Parameter]:
    if node.op == "get_attr":
        try:
            value = gm.get_parameter(node.target)
        except AttributeError:  # a buffer or a constant
            return []
        return [value]
    if node.op == "call_module":
        return list(gm.get_submodule(node.target).parameters())
    return []


def _carries_a_tuple(nodes: list[fx.Node], cut: int, index: dict[fx.Node, int]) -> bool:
    """Whether a value made before ``cut`` is indexed by a getitem at or after it (a tuple would
    cross the boundary, and only tensors may)."""
    for node in nodes[cut:]:
        if node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            if isinstance(source, fx.Node) and index.get(source, cut) < cut:
                return True
    return False


def stage_boundaries(gm: fx.GraphModule, caps: tuple[int, int]) -> list[int]:
    """Indices into ``gm``'s nodes (placeholders and output left out) where a new stage starts,
    ascending; ``[]`` for one stage.

    Parameters that require grad are taken from their last first use back; a stage starts at the
    first use of the parameter that brings the stage's bytes (``numel * element_size``) to the
    cap (``caps[0]`` for the stage that ends the forward, ``caps[1]`` after it). A boundary that a
    tuple would cross moves to the next node; one that leaves no parameter before it is dropped.
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    first_use: dict[int, tuple[int, int]] = {}
    for i, node in enumerate(nodes):
        for p in _parameters_read(gm, node):
            if p.requires_grad:
                first_use.setdefault(id(p), (i, p.numel() * p.element_size()))
    cuts: list[int] = []
    gathered, cap = 0, caps[0]
    for i, size in sorted(first_use.values(), reverse=True):
        gathered += size
        if gathered >= cap:
            cuts.append(i)
            gathered, cap = 0, caps[1]
    starts = []
    for cut in sorted(set(cuts)):
        while 0 < cut < len(nodes) and _carries_a_tuple(nodes, cut, index):
            cut += 1
        if 0 < cut < len(nodes) and (not starts or cut > starts[-1]):
            starts.append(cut)
    before = min((i for i, _ in first_use.values()), default=len(nodes))
    return [s for s in starts if s > before]


def split_at(gm: fx.GraphModule, starts: list[int]) -> fx.GraphModule:
    """``gm`` as a graph that calls one submodule per stage, ``submod_0`` … in order
    (``torch.fx.passes.split_module``; parameters read by ``get_attr`` are passed in as
    arguments, modules with parameters move into the stage that calls them)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}

    def stage(node: fx.Node) -> Any:
        return bisect.bisect_right(starts, index[node])
    return split_module(gm, None, stage, keep_original_order=True)
