"""Spatial means written other ways, part of ``normalize``'s canonical calls.

``normalize`` writes a mean over H, W of a 4-d ``x`` (``x.mean((2, 3))``,
``F.adaptive_avg_pool2d(x, 1)``) as ``sum(x, [2, 3], keepdim=True) * (1 / (H*W))``, reshaped to
``[N, C]`` where the spelling drops H and W; the SE-gate passes recognize that form. This module
finds two more spellings of the same squeeze and the ``x`` they reduce (below);
:func:`spatial_reduction` writes the canonical form for every spelling:

* :func:`whole_window_pool`: ``F.avg_pool2d(x, (H, W))`` (``kernel_size=``, ``nn.AvgPool2d``,
  which ``normalize`` makes that call) whose one window is the whole of ``x``'s H x W: stride
  the kernel size (or not given), padding 0, ``ceil_mode`` false, no ``divisor_override``
  (``count_include_pad`` does not matter without padding). It becomes the keepdim form,
  ``[N, C, 1, 1]``, as ``adaptive_avg_pool2d(x, 1)`` does.
* :func:`flattened_hw`: a ``mean`` or ``sum`` over the last axis of ``x``'s H and W flattened to
  one (``x.flatten(2)``, ``torch.flatten(x, 2)``, ``x.view(n, c, -1)``,
  ``x.reshape(n, c, h * w)``: any of these, or ``torch.reshape``, whose value is
  ``[N, C, H*W]``). It becomes the ``[N, C]`` form, as ``x.mean((2, 3))`` does (``[N, C, 1]``
  with ``keepdim=True``). A view or reshape keeps the elements' order, so the shapes alone say
  that the last axis holds exactly each channel's H x W values.

What is and is not bit-identical (the rewrites are exact in real arithmetic; the rounding is the
one the canonical mean already takes): a flattened ``sum`` sums the same values as
``x.sum((2, 3))``, and on the CPU in the same order (bit-identical in our checks, torch 2.13,
float32/float64/bfloat16, contiguous ``x``); a flattened ``mean`` divides that sum by H*W where
the canonical form multiplies by ``1 / (H*W)``: bit-identical when H*W is a power of two,
otherwise it may differ in the last place, as ``x.mean((2, 3))`` already does. ``avg_pool2d``
sums each window in its own order and divides: on the CPU its float32 value differs from the
canonical one by rounding even for a power-of-two H*W (about 1e-7 relative for unit-normal
inputs; float64 and bfloat16 agreed to the bit for a power of two in our checks) -- the
latitude the canonical mean already takes on CUDA, where the regions and the ``se_gate`` kernel
sum in their own order. Nothing else about the value changes: the dtype, the shape and the
reduced elements are the pool's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...ir.ops import HW_DIMS, avg_pool2d_args, is_call, tensor_meta

__all__ = ["whole_window_pool", "flattened_hw", "spatial_reduction"]

_VIEW_METHODS = ("flatten", "view", "reshape")
_VIEW_FUNCTIONS = (torch.flatten, torch.reshape)
_POOL_ARGS = {"input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
              "divisor_override"}


def _pair(v: Any) -> tuple | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return (v, v)
    return tuple(v) if isinstance(v, (tuple, list)) and len(v) == 2 else None


def whole_window_pool(node: fx.Node) -> fx.Node | None:
    """The input ``x`` when ``node`` is an ``F.avg_pool2d`` call whose one window is all of a
    4-d floating ``x`` (kernel ``(H, W)``, stride the kernel or not given, padding 0,
    ``ceil_mode`` false, no ``divisor_override``; see the module doc), else ``None``. Reads
    shapes from ``meta["val"]``; a node without them is not matched."""
    a = avg_pool2d_args(node)
    x, xv, out = a.get("input"), tensor_meta(a.get("input")), tensor_meta(node)
    if xv is None or out is None or xv.dim() != 4 or not xv.is_floating_point() \
            or out.dtype != xv.dtype:
        return None
    kernel = _pair(a.get("kernel_size"))
    stride = a["stride"]
    stride = kernel if stride is None or (isinstance(stride, (tuple, list)) and not stride) \
        else _pair(stride)
    whole = kernel is not None and kernel == tuple(xv.shape[2:])
    if not whole or stride != kernel or _pair(a["padding"]) != (0, 0) or a["ceil_mode"] \
            or a["divisor_override"] is not None or set(a) - _POOL_ARGS:
        return None
    return x


def flattened_hw(value: object, dim: Any, ssa: bool = True) -> fx.Node | None:
    """The 4-d ``x`` when ``value`` is ``x`` with its H and W flattened to one last axis (a
    ``flatten``, ``view`` or ``reshape``, method or function, whose value is ``[N, C, H*W]`` of
    an ``[N, C, H, W]`` ``x`` of its dtype) and ``dim`` names that axis (``2``, ``-1``, or a
    list or tuple of one of them); else ``None``. In a graph that keeps in-place ops (``ssa``
    false) it is ``None``: a reshape may be a copy taken before a write to ``x``."""
    if not ssa or not isinstance(value, fx.Node) or not value.args:
        return None
    if not ((value.op == "call_method" and value.target in _VIEW_METHODS)
            or is_call(value, *_VIEW_FUNCTIONS)):
        return None
    dims = [dim] if isinstance(dim, int) else dim
    if not isinstance(dims, (tuple, list)) or len(dims) != 1 or isinstance(dims[0], bool) \
            or not isinstance(dims[0], int) or dims[0] not in (2, -1):
        return None
    x = value.args[0]
    xv, flat = tensor_meta(x), tensor_meta(value)
    if xv is None or flat is None or xv.dim() != 4 or flat.dtype != xv.dtype:
        return None
    n, c, h, w = xv.shape
    return x if tuple(flat.shape) == (n, c, h * w) else None


def spatial_reduction(gm: fx.GraphModule, node: fx.Node, x: fx.Node, mean: bool, keepdim: bool,
                      shape: tuple[int, ...] | None = None) -> None:
    """Replace ``node``, a ``sum`` (``mean``) of the 4-d ``x`` over H, W, in place by the
    canonical form ``sum(x, [2, 3], keepdim=True)`` (``* 1/(H*W)``), reshaped to ``shape``
    (``[N, C]`` unless given) where not ``keepdim``. Needs ``meta["val"]`` on ``x``. A mean of a
    half-precision ``x`` sums into fp32 and scales there, then casts to ``x``'s dtype
    (``sum(x, [2, 3], keepdim=True, dtype=torch.float32) * (1/(H*W))``, ``.to(dtype)``), as
    eager's ``mean`` accumulates and divides in fp32 and rounds once: an fp16 sum rounded
    first overflows past 65504 where the mean does not."""
    n, c, h, w = x.meta["val"].shape
    dtype = x.meta["val"].dtype
    half = mean and dtype in (torch.float16, torch.bfloat16)
    g = gm.graph
    with g.inserting_before(node):
        out = g.call_function(torch.sum, (x, list(HW_DIMS)),
                              {"keepdim": True, **({"dtype": torch.float32} if half else {})})
        if mean:
            out = g.call_function(torch.mul, (out, 1.0 / (h * w)))
        if half:
            out = g.call_method("to", (out, dtype))
        if not keepdim:
            out = g.call_function(torch.reshape, (out, shape or (n, c)))
    node.replace_all_uses_with(out)
    g.erase_node(node)
