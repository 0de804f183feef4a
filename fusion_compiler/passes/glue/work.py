"""What Inductor would compile in a lowered graph: the glue's arithmetic."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ...ir.ops import dtype_cast, node_device
from ...ir.region import called_region

__all__ = ["inductor_work"]

_VIEWS = {torch.reshape, torch.flatten, torch.permute, torch.squeeze, torch.unsqueeze,
          torch.transpose, torch.narrow, operator.getitem,
          torch.chunk, torch.split, torch.tensor_split, torch.unbind}  # tuples of views
_VIEW_METHODS = {"view", "reshape", "flatten", "permute", "squeeze", "unsqueeze", "transpose",
                 "size", "dim", "contiguous", "chunk", "split", "tensor_split", "unbind"}


def inductor_work(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of the lowered graph ``gm`` that Inductor would compile: every call but a
    region's on a kernel of its own (a region on PyTorch ops with an op besides its convolution
    is work: its ops are traced into the glue, where Inductor fuses them, as lowering timed them;
    a bare convolution Inductor would only call), one of this package's glue kernels
    (:func:`~fusion_compiler.kernels.se_gate.se_gate`,
    :func:`~fusion_compiler.kernels.se_gate.se_scale`), an indexing of a region's outputs, a
    view or a layout change (``reshape``, ``permute``, ``contiguous`` and the like: at most a
    copy, which Inductor's code would make too; ``chunk``, ``split``, ``tensor_split`` and
    ``unbind``, views of their input), or a cast to a dtype (``.to(dtype)``, the
    autocast pass's) of what is not a layout change: one kernel either way (after a layout
    change, which may copy, Inductor would make one kernel of the two). Empty when Inductor
    would only call, in the same order, the kernels the eager graph calls: then compiling the
    glue gains nothing in a CUDA graph."""
    from ...kernels.se_gate import LIBRARY_OPS  # noqa: PLC0415  (the kernels graphs call)

    return [n for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and _on_pytorch_ops(gm, n)
            and not (n.op == "call_function" and (n.target in _VIEWS or n.target in LIBRARY_OPS))
            and not (n.op == "call_method" and n.target in _VIEW_METHODS)
            and not _dtype_cast(n)]


def _on_pytorch_ops(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is not a call of a region, or one of a CUDA region on PyTorch ops (the
    reference backend) that does more than its convolution. A CPU graph's regions all run on
    PyTorch ops, and ``glue_backend="auto"`` never compiles a CPU graph's glue: what this tells
    of one (as ``fusion-compiler dump`` shows the CUDA pipeline's graph on the CPU) is what the
    CUDA graph's would be with the regions on kernels."""
    region = called_region(gm, node)
    if region is None:
        return True
    return (region.backend == "reference" and node_device(region.conv).type == "cuda"
            and any(n is not region.conv and n.op in ("call_function", "call_method",
                                                      "call_module")
                    for n in region.graph_module.graph.nodes))


def _dtype_cast(node: fx.Node) -> bool:
    """Whether ``node`` is ``x.to(dtype)`` (no device, no other argument) of an ``x`` that is not
    a layout change (an output of a region is read through ``getitem``; ``narrow`` is a view)."""
    if dtype_cast(node) is None:
        return False
    x = node.args[0]
    layout = isinstance(x, fx.Node) and (
        (x.op == "call_function" and x.target in _VIEWS - {operator.getitem, torch.narrow})
        or (x.op == "call_method" and x.target in _VIEW_METHODS))
    return not layout
