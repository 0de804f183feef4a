"""The squeeze-and-excitation kernels: ``fusion_compiler::se_gate`` (the gate) and
``fusion_compiler::se_scale`` (the gate applied, with the block's tail), one Triton program per
sample each.

Squeeze-and-excitation (Hu et al., "Squeeze-and-Excitation Networks", CVPR 2018, eq. 2-4)
computes, per sample ``n`` and channel ``c``::

    s[n, :] = mean over h, w of x[n, :, h, w]                    # squeeze
    g[n, :] = gate(W2 @ act(W1 @ s[n, :] + b1) + b2)             # excitation
    y[n, c] = g[n, c] * x[n, c]                                  # scale

with ``act`` ReLU or SiLU and ``gate`` the sigmoid or the hard sigmoid ``relu6(z + 3) / 6``
(MobileNetV3's, Howard et al., "Searching for MobileNetV3", ICCV 2019, section 5.2).

Inductor compiles the gate as three or four kernels (the spatial sum, then one reduction per
linear layer), since it does not fuse a reduction into the next one. Here one Triton program per
sample streams ``x[n]`` once, keeps ``s`` and the hidden layer in registers and writes ``g[n, :]``
(:func:`se_gate`). :func:`se_scale` goes on in the same program: it streams ``x[n]`` a second
time (from L2: a sample is at most ``FUSED_SQUEEZE`` values where the pass uses it) and writes
``y``, with what a residual block does next applied on the way (``+ residual``, ReLU, ``+ bias``
for a one-element bias), so the block's tail is one kernel where eager PyTorch runs six and
Inductor two. One program streaming a large sample is slow, so for those the pass hands
:func:`se_gate` the pooled ``[N, C, 1, 1]`` mean and leaves the multiply to the graph
(:mod:`fusion_compiler.passes.post_lowering.se_gate`). Measurements: docs/decisions.md, "The SE
gate as one Triton kernel" and "The SE block's tail in the gate's kernel; no Inductor when
nothing is left for it".

Graphs call :func:`se_gate` and :func:`se_scale`, which run the kernel directly on real tensors
and go through the ``torch.library`` op (:data:`OP`, :data:`SCALE_OP`) only while their inputs are
being traced (AOTAutograd, Inductor): an op's first eager call imports Dynamo. On a device other
than CUDA, or where Triton does not import, both run the same formula as torch ops. Both paths
compute in fp32 throughout and round once, so they differ from eager PyTorch in fp16 only by
eager's fp16 roundings of ``s``, the hidden layer, ``g`` and each step of the tail.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ..runtime.region_op import is_traced
from . import load_kernel, next_power_of_two

__all__ = ["se_gate", "se_scale", "se_gate_reference", "se_scale_reference", "MAX_CHANNELS",
           "MAX_HIDDEN", "MAX_GATE_WEIGHT", "OP", "SCALE_OP", "LIBRARY_OPS"]

MAX_CHANNELS = 1024
"""Most channels ``C`` the Triton kernel takes (one program holds a ``[R, C]`` weight tile in
registers); larger gates are left to the graph's own ops by the pass."""
MAX_HIDDEN = 64
"""Most hidden units ``R`` the Triton kernel takes."""
MAX_GATE_WEIGHT = 32768
"""Most elements ``R * C`` of a weight the Triton kernel takes."""


_ACT = {"relu": 0, "silu": 1}
_GATE = {"sigmoid": 0, "hardsigmoid": 1}


def se_gate_reference(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                      w2: torch.Tensor, b2: Optional[torch.Tensor], act: str = "relu",
                      dtype: Optional[torch.dtype] = None, gate: str = "sigmoid"
                      ) -> torch.Tensor:
    """The gate as torch ops in fp32 (see module docstring).

    Args:
        x: ``[N, C, H, W]``, any layout, floating point.
        w1: ``[R, C]``; ``b1``: ``[R]`` or ``None``.
        w2: ``[C, R]``; ``b2``: ``[C]`` or ``None``.
        act: the hidden layer's activation, ``"relu"`` or ``"silu"``.
        dtype: the result's dtype (``None``: ``x.dtype``).
        gate: ``"sigmoid"`` or ``"hardsigmoid"``.

    Returns:
        ``[N, C]`` contiguous.
    """
    s = x.float().mean(dim=(2, 3))
    h = torch.nn.functional.linear(s, w1.float(), None if b1 is None else b1.float())
    h = torch.nn.functional.silu(h) if act == "silu" else torch.relu(h)
    z = torch.nn.functional.linear(h, w2.float(), None if b2 is None else b2.float())
    g = torch.nn.functional.hardsigmoid(z) if gate == "hardsigmoid" else torch.sigmoid(z)
    return g.to(x.dtype if dtype is None else dtype)


def se_scale_reference(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                       w2: torch.Tensor, b2: Optional[torch.Tensor], act: str = "relu",
                       residual: Optional[torch.Tensor] = None, relu: bool = False,
                       bias: Optional[torch.Tensor] = None, gate: str = "sigmoid",
                       dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``y = x * g`` with ``g`` the gate of :func:`se_gate_reference`, then ``+ residual``, ReLU
    (``relu``), ``+ bias``, in fp32, rounded once to ``dtype`` (``None``: ``x.dtype``).

    Args:
        x: ``[N, C, H, W]``, any layout, floating point; ``w1``, ``b1``, ``w2``, ``b2``,
            ``act``, ``gate`` as for :func:`se_gate_reference`.
        residual: ``[N, C, H, W]`` or ``None``.
        bias: one element, or ``None``.

    Returns:
        ``[N, C, H, W]`` in ``dtype`` and ``x``'s layout (``torch.empty_like``).
    """
    y = x.float() * se_gate_reference(x, w1, b1, w2, b2, act, torch.float32,
                                      gate)[:, :, None, None]
    if residual is not None:
        y = y + residual.float()
    if relu:
        y = torch.relu(y)
    if bias is not None:
        y = y + bias.float().reshape(())
    out = torch.empty_like(x, dtype=dtype)
    out.copy_(y)
    return out


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel, compiled on first use; ``None`` when Triton does not import (one
    WARNING on a machine with CUDA, :func:`~fusion_compiler.kernels.load_kernel`)."""
    return load_kernel("se_gate", _define_kernel)


def _define_kernel() -> Any:
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def se_kernel(x, w1, b1, w2, b2, out, res, bias, HW, C, R, s_n, s_hw, s_c, r_n, r_hw, r_c,
                  o_n, o_hw, o_c, inv_hw,
                  HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, ACT: tl.constexpr,
                  GATE: tl.constexpr, SCALE: tl.constexpr, HAS_RES: tl.constexpr,
                  RELU: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        c_in = c < C
        acc = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
        row = x + n * s_n
        for start in range(0, HW, BLOCK_HW):
            hw = start + tl.arange(0, BLOCK_HW)
            mask = (hw < HW)[:, None] & c_in[None, :]
            acc += tl.load(row + hw[:, None] * s_hw + c[None, :] * s_c, mask=mask,
                           other=0.0).to(tl.float32)
        s = tl.sum(acc, axis=0) * inv_hw
        r = tl.arange(0, BLOCK_R)
        r_in = r < R
        w_mask = r_in[:, None] & c_in[None, :]
        # both weights as [R, C] tiles: W1[r, c] and W2[c, r]
        hidden = tl.sum(tl.load(w1 + r[:, None] * C + c[None, :], mask=w_mask,
                                other=0.0).to(tl.float32) * s[None, :], axis=1)
        if HAS_B1:
            hidden += tl.load(b1 + r, mask=r_in, other=0.0).to(tl.float32)
        if ACT == 1:  # SiLU
            hidden = hidden / (1.0 + tl.exp(-hidden))
        else:
            hidden = tl.maximum(hidden, 0.0)
        z = tl.sum(tl.load(w2 + c[None, :] * R + r[:, None], mask=w_mask,
                           other=0.0).to(tl.float32) * hidden[:, None], axis=0)
        if HAS_B2:
            z += tl.load(b2 + c, mask=c_in, other=0.0).to(tl.float32)
        if GATE == 1:  # hard sigmoid: relu6(z + 3) / 6
            gate = tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0
        else:
            gate = 1.0 / (1.0 + tl.exp(-z))
        if SCALE:  # y = tail(x * g), x[n] streamed again
            for start in range(0, HW, BLOCK_HW):
                hw = start + tl.arange(0, BLOCK_HW)
                mask = (hw < HW)[:, None] & c_in[None, :]
                v = tl.load(row + hw[:, None] * s_hw + c[None, :] * s_c, mask=mask,
                            other=0.0).to(tl.float32) * gate[None, :]
                if HAS_RES:
                    v += tl.load(res + n * r_n + hw[:, None] * r_hw + c[None, :] * r_c,
                                 mask=mask, other=0.0).to(tl.float32)
                if RELU:
                    v = tl.maximum(v, 0.0)
                if HAS_BIAS:
                    v += tl.load(bias).to(tl.float32)
                tl.store(out + n * o_n + hw[:, None] * o_hw + c[None, :] * o_c,
                         v.to(out.dtype.element_ty), mask=mask)
        else:
            tl.store(out + n * C + c, gate.to(out.dtype.element_ty), mask=c_in)

    return se_kernel


def _hw_stride(t: torch.Tensor) -> int | None:
    """The stride of ``t``'s H and W flattened to one axis (``[N, C, H, W]``), or ``None`` when
    they do not flatten."""
    _, _, h, w = t.shape
    if w == 1:
        return t.stride(2)
    if h > 1 and t.stride(2) != w * t.stride(3):
        return None
    return t.stride(3)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its H and W flatten to one axis, else a channels_last copy."""
    return t if _hw_stride(t) is not None else t.contiguous(memory_format=torch.channels_last)


def _launch_config(n: int, values: int, block_hw_max: int, block_c: int, block_r: int,
                   scale: bool, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_HW, num_warps)`` for ``n`` programs over samples of ``values`` elements.

    ``x[n]`` is streamed in chunks of 4096 values, faster than up to 16384 at once (and the
    weights before ``x``). For :func:`se_scale` (which streams the sample twice), from per-kernel
    timings of the SE-ResNet9 shapes: samples of at most 4096 values take chunks of 1024; samples
    of at most 8192 values take two warps per program when there are at least two programs per
    SM, and those of at most 4096 eight warps when there are fewer. Measurements:
    docs/decisions.md, "The SE gate as one Triton kernel"."""
    chunk = 1024 if scale and values <= 4096 else 4096
    block_hw = max(1, min(block_hw_max, chunk // block_c))
    warps = 4 if block_c * max(block_r, block_hw) <= 8192 else 8
    if scale and values <= 8192:
        if n >= 2 * _sm_count(device):
            warps = 2
        elif values <= 4096:
            warps = 8
    return block_hw, warps


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(kernel: Any, x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
            w2: torch.Tensor, b2: Optional[torch.Tensor], act: str, scale: bool = False,
            residual: Optional[torch.Tensor] = None, relu: bool = False,
            bias: Optional[torch.Tensor] = None, gate: str = "sigmoid",
            dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    n, c, h, w = x.shape
    r = w1.shape[0]
    src = _flat(x)
    w1, w2 = w1.contiguous(), w2.contiguous()
    if scale:
        result = torch.empty_like(x, dtype=dtype)
        out = _flat(result)  # written in place, or a channels_last buffer copied back below
        res = _flat(residual) if residual is not None else src
        out_strides = (out.stride(0), _hw_stride(out), out.stride(1))
        res_strides = (res.stride(0), _hw_stride(res), res.stride(1))
    else:
        result = out = torch.empty((n, c), dtype=x.dtype, device=x.device)
        res, out_strides = src, (0, 0, 0)
        res_strides = out_strides
    block_c, block_r = next_power_of_two(c), next_power_of_two(r)
    block_hw, warps = _launch_config(n, c * h * w, next_power_of_two(h * w), block_c, block_r,
                                     scale, x.device)
    kernel[(n,)](src, w1, w1 if b1 is None else b1, w2, w2 if b2 is None else b2, out, res,
                 w1 if bias is None else bias, h * w, c, r, src.stride(0), _hw_stride(src),
                 src.stride(1), *res_strides, *out_strides, 1.0 / (h * w),
                 HAS_B1=b1 is not None, HAS_B2=b2 is not None, ACT=_ACT[act], GATE=_GATE[gate],
                 SCALE=scale, HAS_RES=residual is not None, RELU=relu, HAS_BIAS=bias is not None,
                 BLOCK_HW=block_hw, BLOCK_C=block_c, BLOCK_R=block_r, num_warps=warps)
    if out is not result:
        result.copy_(out)
    return result


def _check_act(name: str, act: str, gate: str) -> None:
    if act not in _ACT:
        raise ValueError(f"{name}: act must be 'relu' or 'silu', got {act!r}")
    if gate not in _GATE:
        raise ValueError(f"{name}: gate must be 'sigmoid' or 'hardsigmoid', got {gate!r}")


def _gate(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
          b2: Optional[torch.Tensor], act: str = "relu", gate: str = "sigmoid") -> torch.Tensor:
    _check_act("se_gate", act, gate)
    kernel = _triton_kernel() if x.is_cuda else None
    if kernel is None:
        return se_gate_reference(x, w1, b1, w2, b2, act, gate=gate)
    return _launch(kernel, x, w1, b1, w2, b2, act, gate=gate)


def _scale(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
           b2: Optional[torch.Tensor], act: str = "relu",
           residual: Optional[torch.Tensor] = None, relu: bool = False,
           bias: Optional[torch.Tensor] = None, gate: str = "sigmoid",
           dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    _check_act("se_scale", act, gate)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"se_scale: residual of shape {tuple(residual.shape)} for x of shape "
                         f"{tuple(x.shape)}")
    if bias is not None and bias.numel() != 1:
        raise ValueError(f"se_scale: bias must have one element, got {bias.numel()}")
    kernel = _triton_kernel() if x.is_cuda else None
    if kernel is None:
        return se_scale_reference(x, w1, b1, w2, b2, act, residual, relu, bias, gate, dtype)
    return _launch(kernel, x, w1, b1, w2, b2, act, True, residual, relu, bias, gate, dtype)


@torch.library.custom_op("fusion_compiler::se_gate", mutates_args=())
def _se_gate_op(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                b2: Optional[torch.Tensor], act: str = "relu",
                gate: str = "sigmoid") -> torch.Tensor:
    return _gate(x, w1, b1, w2, b2, act, gate)


@_se_gate_op.register_fake
def _se_gate_fake(x, w1, b1, w2, b2, act="relu", gate="sigmoid"):
    return x.new_empty((x.shape[0], x.shape[1]))


@torch.library.custom_op("fusion_compiler::se_scale", mutates_args=())
def _se_scale_op(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                 b2: Optional[torch.Tensor], act: str, residual: Optional[torch.Tensor],
                 relu: bool, bias: Optional[torch.Tensor], gate: str = "sigmoid",
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return _scale(x, w1, b1, w2, b2, act, residual, relu, bias, gate, dtype)


@_se_scale_op.register_fake
def _se_scale_fake(x, w1, b1, w2, b2, act, residual, relu, bias, gate="sigmoid", dtype=None):
    return torch.empty_like(x, dtype=dtype)


OP = torch.ops.fusion_compiler.se_gate.default
"""The gate's op overload (what a traced graph calls)."""
SCALE_OP = torch.ops.fusion_compiler.se_scale.default
"""The scale's op overload (what a traced graph calls)."""


def se_gate(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
            b2: Optional[torch.Tensor], act: str = "relu", gate: str = "sigmoid") -> torch.Tensor:
    """``gate(W2 @ act(W1 @ mean_hw(x) + b1) + b2)`` per sample (see module docstring).

    Args:
        x: ``[N, C, H, W]``, any layout (one whose H and W do not flatten to one axis is copied
            to channels_last first), floating point.
        w1: ``[R, C]``; ``b1``: ``[R]`` or ``None``; ``w2``: ``[C, R]``; ``b2``: ``[C]`` or
            ``None``; ``R * C`` at most :data:`MAX_GATE_WEIGHT`, ``C`` at most
            :data:`MAX_CHANNELS`, ``R`` at most :data:`MAX_HIDDEN` for the Triton kernel.
        act: ``"relu"`` or ``"silu"``.
        gate: ``"sigmoid"`` or ``"hardsigmoid"``.

    Returns:
        ``[N, C]`` contiguous, ``x.dtype``. One Triton program per sample on CUDA, torch ops
        elsewhere (:func:`se_gate_reference`); through :data:`OP` while ``x`` is traced.

    Raises:
        ValueError: another ``act`` or ``gate``.
    """
    if is_traced(x):
        return OP(x, w1, b1, w2, b2, act, gate)
    return _gate(x, w1, b1, w2, b2, act, gate)


def se_scale(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
             b2: Optional[torch.Tensor], act: str = "relu",
             residual: Optional[torch.Tensor] = None, relu: bool = False,
             bias: Optional[torch.Tensor] = None, gate: str = "sigmoid",
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x * g`` with ``g`` the gate of :func:`se_gate` broadcast over H and W, then
    ``+ residual``, ReLU (``relu``), ``+ bias``, rounded once to ``dtype`` (see module
    docstring).

    Args:
        x, w1, b1, w2, b2, act, gate: as for :func:`se_gate`.
        residual: ``[N, C, H, W]`` (any layout) or ``None``.
        bias: a tensor of one element (any shape, any floating dtype) or ``None``.
        dtype: the result's floating dtype (``None``: ``x.dtype``), such as fp32 where a graph
            casts the block's output up (the autocast pass's cast after the last block).

    Returns:
        ``[N, C, H, W]``, ``dtype``, laid out as ``torch.empty_like(x)``. One Triton program
        per sample on CUDA, torch ops elsewhere (:func:`se_scale_reference`); through
        :data:`SCALE_OP` while ``x`` is traced.

    Raises:
        ValueError: another ``act`` or ``gate``, a residual of another shape, a bias of several
            elements.
    """
    if is_traced(x):
        return SCALE_OP(x, w1, b1, w2, b2, act, residual, relu, bias, gate, dtype)
    return _scale(x, w1, b1, w2, b2, act, residual, relu, bias, gate, dtype)


LIBRARY_OPS = {se_gate: OP, se_scale: SCALE_OP}
"""This package's kernels between regions: each function graphs call and its op overload
(positional arguments in the same order). What the glue pass ``library_ops``, ``inductor_work``
and the reports' tables know them by."""
