"""The side stream: a second CUDA stream per device on which a region may run beside the regions of
the current stream, inside the same CUDA graph, and the ``fusion_compiler::join_side_stream`` op
that makes the current stream wait for it. The schedule (which regions go beside, where the fork
and the join sit) is the post-lowering pass
:func:`fusion_compiler.passes.post_lowering.streams.run_short_branches_beside`.

In a CUDA graph capture the waits become edges of the graph: one replay runs both streams' work at
once. Outside a capture they cost a few microseconds of host time per region.
"""

from __future__ import annotations

import torch

from .region_op import in_dry_run

__all__ = ["side_stream", "join_side_stream", "MAIN_WORKSPACE", "SIDE_WORKSPACE"]

MAIN_WORKSPACE, SIDE_WORKSPACE = "main", "side"
"""Workspace keys (:meth:`~fusion_compiler.backends.cudnn.backend.CudnnBackend.workspace`) of
kernels on the current stream and of kernels on the side stream."""

_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA ``device``, made at the first call and kept."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


@torch.library.custom_op("fusion_compiler::join_side_stream", mutates_args=("outputs",))
def join_side_stream(outputs: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
    """Make the current stream wait for the side stream of ``outputs``' device (see the module
    doc). ``outputs``: what a side-stream region returned (declared mutated, not touched);
    ``keep``: its other tensor inputs, held until here. A no-op for CPU tensors and in a
    :func:`~.region_op.dry_run` (the background glue compile's run, whose regions, forks
    included, do not run: it leaves the side stream to the calling thread)."""
    if outputs and outputs[0].is_cuda and not in_dry_run():
        device = outputs[0].device
        torch.cuda.current_stream(device).wait_stream(side_stream(device))


@join_side_stream.register_fake
def _join_fake(outputs: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
    return None
