"""The ``fusion_compiler::se_gate`` custom op: a squeeze-and-excitation gate in one kernel.

Squeeze-and-excitation (Hu et al., "Squeeze-and-Excitation Networks", CVPR 2018, eq. 2-3)
computes, per sample ``n`` and channel ``c``::

    s[n, :] = mean over h, w of x[n, :, h, w]                    # squeeze
    g[n, :] = sigmoid(W2 @ act(W1 @ s[n, :] + b1) + b2)          # excitation, act: ReLU or SiLU

and the block then multiplies ``x`` by ``g``. Inductor compiles this as three or four kernels (the
spatial sum, then one reduction per linear layer), since it does not fuse a reduction into the next
one. Here one Triton program per sample does it all: it streams ``x[n]`` once, keeps ``s`` and the
hidden layer in registers, and writes ``g[n, :]``. The multiply by ``g`` stays outside, where
Inductor fuses it with the residual add and ReLU that follow. One program streaming a large sample
is slow, so for those the pass hands the op the pooled ``[N, C, 1, 1]`` mean, and the program only
runs the two layers (:mod:`fusion_compiler.passes.glue.se_gate`, ``FUSED_SQUEEZE``). Measurements:
docs/decisions.md, "The SE gate as one Triton kernel".

On a device other than CUDA, or where Triton does not import, the op runs the same formula as
torch ops (fp32 accumulation, the result in ``x``'s dtype). Both paths compute in fp32 throughout,
so they differ from eager PyTorch in fp16 only by eager's fp16 roundings of ``s`` and the hidden
layer.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

__all__ = ["se_gate", "se_gate_reference", "MAX_CHANNELS", "MAX_HIDDEN", "MAX_GATE_WEIGHT", "OP"]

MAX_CHANNELS = 1024
"""Most channels ``C`` the Triton kernel takes (one program holds a ``[R, C]`` weight tile in
registers); larger gates are left to the graph's own ops by the pass."""
MAX_HIDDEN = 64
"""Most hidden units ``R`` the Triton kernel takes."""
MAX_GATE_WEIGHT = 32768
"""Most elements ``R * C`` of a weight the Triton kernel takes."""


_ACT = {"relu": 0, "silu": 1}


def se_gate_reference(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
                      w2: torch.Tensor, b2: Optional[torch.Tensor], act: str = "relu"
                      ) -> torch.Tensor:
    """The gate as torch ops in fp32 (see module docstring).

    Args:
        x: ``[N, C, H, W]``, any layout, floating point.
        w1: ``[R, C]``; ``b1``: ``[R]`` or ``None``.
        w2: ``[C, R]``; ``b2``: ``[C]`` or ``None``.
        act: the hidden layer's activation, ``"relu"`` or ``"silu"``.

    Returns:
        ``[N, C]`` contiguous, ``x.dtype``.
    """
    s = x.float().mean(dim=(2, 3))
    h = torch.nn.functional.linear(s, w1.float(), None if b1 is None else b1.float())
    h = torch.nn.functional.silu(h) if act == "silu" else torch.relu(h)
    z = torch.nn.functional.linear(h, w2.float(), None if b2 is None else b2.float())
    return torch.sigmoid(z).to(x.dtype)


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel, compiled on first use; ``None`` when Triton does not import."""
    try:
        import triton  # noqa: F401, PLC0415
        import triton.language as tl  # noqa: PLC0415
    except Exception:  # ImportError, or a broken install
        return None

    @triton.jit
    def se_gate_kernel(x, w1, b1, w2, b2, g, HW, C, R, s_n, s_hw, s_c, inv_hw,
                       HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, ACT: tl.constexpr,
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
        gate = 1.0 / (1.0 + tl.exp(-z))
        tl.store(g + n * C + c, gate.to(g.dtype.element_ty), mask=c_in)

    return se_gate_kernel


def _pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _launch(kernel: Any, x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor],
            w2: torch.Tensor, b2: Optional[torch.Tensor], act: str) -> torch.Tensor:
    n, c, h, w = x.shape
    r = w1.shape[0]
    if h > 1 and w > 1 and x.stride(2) != w * x.stride(3):  # h and w must flatten to one axis
        x = x.contiguous(memory_format=torch.channels_last)
    w1, w2 = w1.contiguous(), w2.contiguous()
    g = torch.empty((n, c), dtype=x.dtype, device=x.device)
    block_c, block_r = _pow2(c), _pow2(r)
    # x[n] in chunks of 4096 values: faster than loading up to 16384 at once (and the weights
    # before x); measurements: docs/decisions.md, "The SE gate as one Triton kernel"
    block_hw = max(1, min(_pow2(h * w), 4096 // block_c))
    kernel[(n,)](x, w1, w1 if b1 is None else b1, w2, w2 if b2 is None else b2, g,
                 h * w, c, r, x.stride(0), x.stride(3) if w > 1 else x.stride(2), x.stride(1),
                 1.0 / (h * w), HAS_B1=b1 is not None, HAS_B2=b2 is not None, ACT=_ACT[act],
                 BLOCK_HW=block_hw, BLOCK_C=block_c, BLOCK_R=block_r,
                 num_warps=4 if block_c * max(block_r, block_hw) <= 8192 else 8)
    return g


@torch.library.custom_op("fusion_compiler::se_gate", mutates_args=())
def se_gate(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
            b2: Optional[torch.Tensor], act: str = "relu") -> torch.Tensor:
    """``sigmoid(W2 @ act(W1 @ mean_hw(x) + b1) + b2)`` per sample, ``act`` ``"relu"`` or
    ``"silu"`` (else ``ValueError``): ``x`` ``[N, C, H, W]``
    (any layout whose H and W flatten to one axis, else it is copied to channels_last),
    ``w1`` ``[R, C]``, ``w2`` ``[C, R]``, biases ``[R]``/``[C]`` or ``None``; returns ``[N, C]``
    in ``x.dtype``. One Triton program per sample on CUDA (see module docstring), torch ops
    elsewhere (:func:`se_gate_reference`)."""
    if act not in _ACT:
        raise ValueError(f"se_gate: act must be 'relu' or 'silu', got {act!r}")
    kernel = _triton_kernel() if x.is_cuda else None
    if kernel is None:
        return se_gate_reference(x, w1, b1, w2, b2, act)
    return _launch(kernel, x, w1, b1, w2, b2, act)


@se_gate.register_fake
def _se_gate_fake(x, w1, b1, w2, b2, act="relu"):
    return x.new_empty((x.shape[0], x.shape[1]))


OP = torch.ops.fusion_compiler.se_gate.default
"""The op overload that graphs call (``call_function`` target)."""
