"""A region's depthwise convolution and its epilogue as one Triton kernel.

A depthwise convolution (``groups`` = input channels = output channels: MobileNet's and
EfficientNet's 3x3 and 5x5 layers; Howard et al., "MobileNets", 2017, section 3.1) does
``R * S`` multiply-adds per output element, so its time is the time to read its input and write
its output. cuDNN runs these regions on engines that build a kernel at run time
(``cudnn_generated_convFwd_pointwise...``), at 5-30% of the GPU's memory bandwidth on
MobileNetV2's layers (docs/decisions.md, "Depthwise convolutions as a Triton kernel of our
own"). The kernel (:mod:`.depthwise_triton`) computes ``conv2d(x, w, None, stride, padding,
dilation, groups=C)`` for fp16 or bf16 ``x`` ``[N, C, H, W]`` (converted to channels_last unless
its channels are innermost already) and ``w`` ``[C, 1, R, S]`` (any strides; read where it is),
accumulates in fp32 with plain multiply-adds, runs the region's epilogue on the fp32 value (the
ops and limits of :mod:`.conv`: add, sub, mul, div with a scalar, per-channel or full operand;
ReLU, sigmoid, tanh, SiLU, ``clamp(x, 0, c)``) and writes up to two values of the chain
channels_last, each rounded once.

:func:`depthwise_program` reads a region (:func:`~.conv.conv_program` with ``depthwise``),
:class:`DepthwiseKernel` is what the ``triton_depthwise`` backend
(:mod:`fusion_compiler.backends.triton_depthwise`) lowers it to, :func:`depthwise_reference` is the same
computation as torch ops (an fp64 oracle for fp64 inputs).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..ir.region import Region
from . import load_kernel, next_power_of_two, triton_unavailable
from .conv import ConvKernel, ConvProgram, TileConfig, chain_arguments, conv_program, output_hw
from .epilogue import reference_outputs

__all__ = ["WIDE_OFFSETS", "depthwise_program", "depthwise_reference", "default_config",
           "candidate_configs", "launch", "triton_kernel", "triton_reason", "DepthwiseKernel"]


WIDE_OFFSETS = 2 ** 31
"""Elements from which the kernel computes offsets in 64 bits (below it, in 32: fewer
instructions per loaded value)."""


def depthwise_program(region: Region, device: torch.device) -> ConvProgram | str:
    """The kernel's arguments for ``region`` (a :class:`~.conv.ConvProgram`), or why the kernel
    cannot run it (a text): the convolution must be depthwise, fp16 or bf16, its epilogue one
    :mod:`.conv`'s kernel takes."""
    return conv_program(region, device, depthwise=True)


def depthwise_reference(x: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor],
                        program: ConvProgram) -> list[torch.Tensor]:
    """The kernel's computation as torch ops: the convolution and epilogue in fp32 (fp64 for
    fp64 inputs: an oracle), each requested value rounded to ``x.dtype`` once, channels_last.
    ``operands``: the tensors of ``program.operands``, in order."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = F.conv2d(x.to(acc), weight.to(acc), None, program.stride, program.padding,
                 program.dilation, x.shape[1])
    return reference_outputs(y, program.ops, operands, program.outputs, x.dtype)


def default_config(m: int, c: int) -> TileConfig:
    """The launch configuration for ``m`` output pixels and ``c`` channels: ``bn`` channels per
    program (up to 64, 128 bytes of fp16 in a row), ``bm`` pixels so that a program holds 4096
    outputs (16 per thread of 4 warps); ``bk`` is unused. A heuristic: the first of
    :func:`candidate_configs`, the one taken untimed (``autotune <= 1``)."""
    bn = min(64, max(8, next_power_of_two(c)))
    bm = min(max(32, 4096 // bn), max(32, next_power_of_two(m)))
    return TileConfig(bm, bn, 1, warps=4)


def candidate_configs(m: int, c: int) -> list[TileConfig]:
    """The configurations autotuning times: :func:`default_config` first, then narrower and
    wider channel tiles and 8 warps, each clamped to the shape."""
    found = [default_config(m, c)]
    for bm, bn, warps in ((128, 32, 4), (32, 128, 4), (128, 64, 8), (64, 32, 4)):
        bn = min(bn, max(8, next_power_of_two(c)))
        config = TileConfig(min(bm, max(32, next_power_of_two(m))), bn, 1, warps=warps)
        if config not in found:
            found.append(config)
    return found


@functools.cache
def triton_kernel() -> Any:
    """The Triton kernel module (:mod:`.depthwise_triton`), compiled per configuration on first
    use; ``None`` when Triton does not import."""
    def load() -> Any:
        from . import depthwise_triton  # noqa: PLC0415  (imports triton)
        return depthwise_triton

    return load_kernel("depthwise_nhwc", load)


def triton_reason() -> str:
    """Why the kernel cannot run here (``""``: it can): Triton must import and CUDA must be
    available."""
    return triton_unavailable(triton_kernel)


def launch(kernels: Any, x: torch.Tensor, weight: torch.Tensor,
           operands: Sequence[torch.Tensor], program: ConvProgram,
           config: TileConfig | None = None) -> list[torch.Tensor]:
    """Run ``kernels`` (:func:`triton_kernel`, or the module interpreted in tests) on ``x``
    ``[N, C, H, W]``, ``weight`` ``[C, 1, R, S]`` and the epilogue's ``operands``; returns one
    channels_last ``[N, C, HO, WO]`` tensor of ``x.dtype`` per ``program.outputs`` entry."""
    if x.stride(1) != 1:
        x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    _, _, r, s = weight.shape
    ho, wo = output_hw(h, w, r, s, program)
    m = n * ho * wo
    config = config or default_config(m, c)
    ys = [torch.empty((n, c, ho, wo), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last) for _ in program.outputs]
    pointers, chain = chain_arguments(program, operands, weight)
    (sh, sw), (ph, pw), (dh, dw) = program.stride, program.padding, program.dilation
    tiles = -(-m // config.bm) * -(-c // config.bn)
    spans = [1 + sum((d - 1) * st for d, st in zip(t.shape, t.stride())) for t in (x, weight)]
    wide = max(*spans, (tiles * config.bm + 1) * c) >= WIDE_OFFSETS
    kernels.depthwise_nhwc_kernel[(tiles,)](
        x, weight, ys[0], ys[-1], *pointers, m, c, h, w, ho, wo, *x.stride(),
        weight.stride(0), weight.stride(2), weight.stride(3),
        R=r, S=s, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw, BM=config.bm, BC=config.bn,
        EVEN_C=c % config.bn == 0, WIDE=wide, **chain, num_warps=config.warps)
    return ys


class DepthwiseKernel(ConvKernel):
    """A depthwise region's kernel: :func:`launch` on the region's inputs in its order, with the
    calling conventions of :class:`~.conv.ConvKernel` (directly, or through ``run_region`` when
    traced; nothing launched in a dry run). The weight is read where it is (no derived copy)."""

    kernels = staticmethod(triton_kernel)
    launch = staticmethod(launch)
    reference = staticmethod(depthwise_reference)

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight
