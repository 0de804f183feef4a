"""The ``fusion_compiler::space_to_depth_conv`` op: SpaceToDepth, a 1x1 convolution and its
epilogue as one Triton kernel that reads the NCHW image once.

The SE-ResNet9 stem is ``SpaceToDepth(4)``, a 1x1 convolution on ``16*C`` channels, ReLU and the
next block's bias. cuDNN takes the pair only as a 4x4, stride-4 convolution on the ``C``-channel
image, which it runs far slower for ``C`` = 3 or 11 than a copy plus a 1x1 convolution (the
pre-fusion rewrite ``space_to_depth``). Here one Triton program per 4 output rows loads the image
rows of all channels contiguously, rearranges them in registers and multiplies once with
``tl.dot`` by the weight, packed to match once per weight version (:func:`packed_weight`;
:mod:`.space_to_depth_triton`). The epilogue is computed in fp32 and rounded once per output, as
cuDNN's fp32 intermediates are; outputs are channels_last, as a cuDNN region's. An fp32 image with
a half-precision weight (the stem under ``torch.autocast``, whose cast of the image the region
takes along) is rounded to the weight's dtype as the kernel loads it. Measurements:
``docs/decisions.md``, "The SpaceToDepth stem as one Triton kernel".

The region-level pieces: the fusion pass ``space_to_depth_stem`` gives a region the SpaceToDepth
as its prologue when this kernel takes it (:func:`kernel_reason`, :func:`epilogue_program`), and
the ``triton`` backend (:mod:`fusion_compiler.backends.triton_stem`) lowers such regions to
:class:`SpaceToDepthConvKernel`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..ir.region import Region
from ..runtime.region_op import in_dry_run, is_traced
from ..runtime.weight_cache import WeightCache
from . import load_kernel, triton_unavailable
from .epilogue import BINARY, CODES, SILU, binary_operand, epilogue_chain, reference_outputs

__all__ = ["space_to_depth_conv", "space_to_depth_conv_reference", "kernel_reason",
           "triton_reason", "epilogue_program", "SpaceToDepthConvKernel", "OP", "BLOCK",
           "MAX_STEPS", "MAX_OUTPUTS"]

BLOCK = 4
"""The SpaceToDepth block size the kernel takes: its ``tl.dot`` sums ``BLOCK**2`` taps per image
channel, and Triton's dot needs at least 16."""
MAX_STEPS = 4
"""Most epilogue ops after the convolution."""
MAX_OUTPUTS = 2
"""Most region outputs (values of the chain: the convolution's or any epilogue op's)."""
_MAX_CHANNELS = 128  # output channels: the fp32 accumulator is [rows, K] in registers
_ROWS = 64  # output pixels per program: 4 output rows of 16 on the depth stem; the fastest of
# 16 to 128 (measurements: docs/decisions.md, "The SpaceToDepth stem as one Triton kernel")
_TILE = 16384  # most image elements a program loads per step (32 KB of fp16 in registers)

# the epilogue ops the kernel runs: the shared codes but SiLU
_CODES = {fn: code for fn, code in CODES.items() if code != SILU}


def _space_to_depth(x: torch.Tensor, b: int) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4).reshape(
        n, b * b * c, h // b, w // b)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the op computes in and returns: the weight's where an fp32 image meets a
    half-precision weight (autocast), else the image's."""
    low = (torch.float16, torch.bfloat16)
    return weight.dtype if x.dtype == torch.float32 and weight.dtype in low else x.dtype


def space_to_depth_conv_reference(x: torch.Tensor, weight: torch.Tensor,
                                  operands: Sequence[torch.Tensor], ops: Sequence[int],
                                  outputs: Sequence[int], block: int) -> list[torch.Tensor]:
    """The op as torch ops (see :func:`space_to_depth_conv` for the arguments): the image rounded
    to the output dtype, computed in fp32 (fp64 for fp64 inputs: an oracle) and rounded to the
    output dtype once per output."""
    dtype = _out_dtype(x, weight)
    acc = torch.promote_types(dtype, torch.float32)
    y = F.conv2d(_space_to_depth(x, block).to(dtype).to(acc), weight.to(acc))
    return reference_outputs(y, ops, operands, outputs, dtype)


@functools.cache
def _triton_kernel() -> Any:
    """The Triton kernel (:mod:`.space_to_depth_triton`), compiled on first use; ``None`` when
    Triton does not import."""
    def load() -> Any:
        from . import space_to_depth_triton  # noqa: PLC0415  (imports triton)
        return space_to_depth_triton.space_to_depth_conv_kernel

    return load_kernel("space_to_depth_conv", load)


def triton_reason() -> str:
    """Why the Triton kernel cannot run here (``""``: it can): Triton must import and CUDA must
    be available."""
    return triton_unavailable(_triton_kernel)


def _rows_per_program(ho: int, wo: int) -> int:
    """Output rows per program: :data:`_ROWS` pixels where ``ho`` allows (a power of two)."""
    hb = max(1, _ROWS // wo)
    while hb > 1 and ho % hb:
        hb //= 2
    return hb


def _channels_per_step(c: int, rows: int, w: int) -> int:
    """Image channels a program loads per step: all ``c`` (rounded up to a power of two) where
    their ``rows`` x ``w`` tiles hold at most :data:`_TILE` elements, else the most that do (a
    power of two, at least 1)."""
    fits = max(1, _TILE // (rows * w))
    return min(1 << (c - 1).bit_length(), 1 << (fits.bit_length() - 1))


_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight (its base) -> {(C, CG): cache}


def _pack(weight: torch.Tensor, c: int, cg: int) -> torch.Tensor:
    k = weight.shape[0]
    taps = weight.reshape(k, -1, c).permute(2, 1, 0)  # [C, B*B, K]: (c, dh*B + dw, k)
    packed = weight.new_zeros((-(-c // cg) * cg, taps.shape[1], k))
    packed[:c] = taps
    return packed.reshape(-1, k)


def packed_weight(weight: torch.Tensor, c: int, cg: int) -> torch.Tensor:
    """``weight`` ``[K, B*B*C, 1, 1]`` (SpaceToDepth's channel order ``(dh*B + dw)*C + c``) as the
    kernel reads it: ``[CP*B*B, K]`` contiguous, row ``(c*B + dh)*B + dw``, ``CP`` = ``c`` rounded
    up to a multiple of ``cg`` (the channels per step), zero rows past ``c``, so that each step
    loads its rows as one contiguous tile. Made once per weight version and kept beside the
    weight (:class:`~fusion_compiler.runtime.weight_cache.WeightCache`)."""
    base = weight if weight._base is None else weight._base
    caches = _PACKED.setdefault(base, {})
    if (c, cg) not in caches:
        caches[(c, cg)] = WeightCache(functools.partial(_pack, c=c, cg=cg), rearrangement=True)
    return caches[(c, cg)](weight)


def kernel_reason(x: torch.Tensor, weight: torch.Tensor, block: int) -> str:
    """Why the Triton kernel cannot take these shapes (``""``: it can). ``x`` ``[N, C, H, W]``,
    ``weight`` ``[K, block**2 * C, 1, 1]`` (tensors or their metadata)."""
    n, c, h, w = x.shape
    k = weight.shape[0]
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if block != BLOCK:
        return f"SpaceToDepth block {block}; the kernel takes {BLOCK}"
    if weight.dtype not in (torch.float16, torch.bfloat16) \
            or x.dtype not in (weight.dtype, torch.float32):
        return (f"dtypes {x.dtype} and {weight.dtype}; the kernel takes a float16 or bfloat16 "
                "weight and an image of its dtype or float32")
    if not pow2(w) or h % block:
        return f"image width {w} is not a power of two, or height {h} not a multiple of {block}"
    if not pow2(k) or not 16 <= k <= _MAX_CHANNELS:
        return f"{k} output channels; the kernel takes a power of two from 16 to {_MAX_CHANNELS}"
    if _rows_per_program(h // block, w // block) * (w // block) < 16:
        return "fewer than 16 output pixels per program (Triton's dot needs 16 rows)"
    return ""


def _launch(kernel: Any, x: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor],
            ops: Sequence[int], outputs: Sequence[int], block: int) -> list[torch.Tensor]:
    x = x.contiguous()
    n, c, h, w = x.shape
    k = weight.shape[0]
    ho, wo = h // block, w // block
    ys = [torch.empty((n, k, ho, wo), dtype=weight.dtype, device=x.device,
                      memory_format=torch.channels_last) for _ in outputs]
    codes = [*ops, *[0] * (MAX_STEPS - len(ops))]
    pointers, strides, it = [], [], iter(operands)
    for code in codes:
        if code in BINARY:
            t = next(it).reshape(-1).contiguous()
            pointers.append(t)
            strides.append(0 if t.numel() == 1 else 1)
        else:
            pointers.append(weight)  # not read
            strides.append(0)
    stages = [*outputs, *[-1] * (MAX_OUTPUTS - len(outputs))]
    hb = _rows_per_program(ho, wo)
    cg = _channels_per_step(c, hb * block, w)
    kernel[(n * (ho // hb),)](
        x, packed_weight(weight, c, cg), ys[0], ys[-1], *pointers, *strides,
        C=c, H=h, W=w, K=k, B=block, HB=hb, CG=cg, OP0=codes[0], OP1=codes[1], OP2=codes[2],
        OP3=codes[3], OUT0=stages[0], OUT1=stages[1], num_warps=4)
    return ys


@torch.library.custom_op("fusion_compiler::space_to_depth_conv", mutates_args=())
def space_to_depth_conv(x: torch.Tensor, weight: torch.Tensor, operands: list[torch.Tensor],
                        ops: list[int], outputs: list[int], block: int) -> list[torch.Tensor]:
    """SpaceToDepth(``block``), a 1x1 convolution, then the epilogue ``ops``.

    Args:
        x: ``[N, C, H, W]`` image, float16 or bfloat16, or float32 with a half-precision weight
            (rounded to its dtype; copied to NCHW-contiguous if it is not).
        weight: ``[K, block**2 * C, 1, 1]``, input channel ``(dh*block + dw)*C + c`` for image
            channel ``c`` at offset ``(dh, dw)`` of a block (SpaceToDepth's order).
        operands: the second operand of each binary op of ``ops``, in order: ``[1, K, 1, 1]`` (or
            ``[K]``) per channel, or one element.
        ops: epilogue op codes, at most :data:`MAX_STEPS`: 1 add, 2 sub, 3 mul, 4 div, 5 ReLU,
            6 sigmoid, 7 tanh; the chain value is the first operand.
        outputs: which values to return, at most :data:`MAX_OUTPUTS`: 0 the convolution's,
            ``i`` the value after ``ops[i - 1]``.
        block: the SpaceToDepth block size.

    Returns:
        One ``[N, K, H/block, W/block]`` tensor per ``outputs`` entry, channels_last, of
        ``x.dtype`` (the weight's for an fp32 image with a half-precision weight);
        computed in fp32 and rounded once. On CUDA with Triton one kernel
        (:data:`BLOCK`, shapes per :func:`kernel_reason`); elsewhere torch ops
        (:func:`space_to_depth_conv_reference`).

    In a :func:`~fusion_compiler.runtime.region_op.dry_run` the outputs are uninitialized and
    nothing runs.

    Raises:
        ValueError: more than :data:`MAX_STEPS` ops or :data:`MAX_OUTPUTS` outputs, or shapes the
            Triton kernel does not take on CUDA.
    """
    return _run(x, weight, operands, ops, outputs, block)


def _run(x: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor],
         ops: Sequence[int], outputs: Sequence[int], block: int) -> list[torch.Tensor]:
    """The op's body (see :func:`space_to_depth_conv`), which its kernel also calls directly:
    the first call of a ``torch.library`` op goes through a wrapper that imports Dynamo, seconds
    that would otherwise land before a warm process's first output."""
    if len(ops) > MAX_STEPS or not 1 <= len(outputs) <= MAX_OUTPUTS:
        raise ValueError(f"space_to_depth_conv: at most {MAX_STEPS} ops and 1 to {MAX_OUTPUTS} "
                         f"outputs, got {len(ops)} and {len(outputs)}")
    if in_dry_run():  # a background compile's run: outputs of the right shapes, nothing run
        return _space_to_depth_conv_fake(x, weight, operands, ops, outputs, block)
    kernel = _triton_kernel() if x.is_cuda else None
    if kernel is None:
        return space_to_depth_conv_reference(x, weight, operands, ops, outputs, block)
    if reason := kernel_reason(x, weight, block):
        raise ValueError(f"space_to_depth_conv: {reason}")
    return _launch(kernel, x, weight, operands, ops, outputs, block)


@space_to_depth_conv.register_fake
def _space_to_depth_conv_fake(x, weight, operands, ops, outputs, block):
    n, _, h, w = x.shape
    return [torch.empty((n, weight.shape[0], h // block, w // block),
                        dtype=_out_dtype(x, weight), device=x.device,
                        memory_format=torch.channels_last) for _ in outputs]


OP = torch.ops.fusion_compiler.space_to_depth_conv.default
"""The op overload a stem region's kernel calls."""


class SpaceToDepthConvKernel:
    """A stem region's kernel: the op on the region's inputs in its order, called directly, or as
    :data:`OP` (one opaque op) when its inputs are being traced.

    ``operands``: for each binary epilogue op, the position of its region input, or a one-element
    fp32 tensor for a number in the graph. In a :func:`~fusion_compiler.runtime.region_op.dry_run`
    the op returns uninitialized outputs and launches nothing.
    """

    def __init__(self, image_at: int, weight_at: int, operands: list[int | torch.Tensor],
                 ops: list[int], outputs: list[int], block: int):
        self.image_at, self.weight_at, self.block = image_at, weight_at, block
        self.operands, self.ops, self.outputs = operands, ops, outputs

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, weight = inputs[self.image_at], inputs[self.weight_at]
        operands = [inputs[o] if isinstance(o, int) else o for o in self.operands]
        run = OP if is_traced(x) else _run
        return tuple(run(x, weight, operands, self.ops, self.outputs, self.block))


def epilogue_program(region: Region, device: torch.device
                     ) -> tuple[list[int | torch.Tensor], list[int], list[int]] | str:
    """``(operands, ops, outputs)`` of ``region``'s epilogue (the ops after its convolution) as
    :class:`SpaceToDepthConvKernel` takes them, or why the kernel cannot run it (a text).
    Numbers of the graph become one-element fp32 tensors on ``device``."""
    chain = epilogue_chain(region, _CODES, BINARY, MAX_STEPS, MAX_OUTPUTS, prologue=True)
    if isinstance(chain, str):
        return chain
    steps, outputs = chain
    operands = []
    for step in steps:
        if step.code in BINARY:
            operand = binary_operand(step, region, ("scalar", "channel"), device)
            if operand is None:
                return f"{step.node.name}'s operand is not a number or a per-channel tensor"
            operands.append(operand[0])
    return operands, [step.code for step in steps], outputs
