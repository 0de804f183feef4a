"""A region's forward convolution and its epilogue as one Hopper kernel: TMA loads and wgmma
(:mod:`.conv_hopper_gluon`, written in Triton's Gluon dialect).

The kernel computes ``conv2d(x, w, None, stride, padding, 1, 1)`` for fp16 or bf16 ``x``
``[N, C, H, W]`` (read as NHWC: converted to channels_last unless its channels are innermost and its
rows 16-byte aligned already) and ``w`` ``[K, C, R, S]`` (read as a ``[K, R*S*C]`` matrix of its
channels_last copy, converted once per weight version), any filter size and padding, stride 1 or 2
(2 on even image sizes), dilation 1, ``C`` a multiple of 16 (a TMA box row holds 16 to 64 channels),
accumulates in fp32 on the tensor cores, runs the region's epilogue (the ops, operands and limits of
:mod:`.conv`'s kernel) on the fp32 value and writes up to two values of the chain channels_last,
each rounded once. It runs on compute capability 9.0 only (wgmma is sm_90a's).

The region-level pieces follow :mod:`.conv`: :func:`hopper_program` reads a region (or says why
not), :class:`HopperConvKernel` is what the ``hopper_conv`` backend
(:mod:`fusion_compiler.backends.hopper_conv`) lowers it to, and its reference is
:func:`~.conv.conv_reference`. A :class:`~.conv.TileConfig` gives ``bm`` output pixels (64 or
128) by ``bn`` output channels, ``bk`` channels per step, ``stages`` and ``warps``; the pixels
are a box of whole images, rows and columns (:func:`pixel_box`).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from ..ir.region import Region
from . import load_kernel, next_power_of_two, triton_unavailable
from .conv import ConvKernel, ConvProgram, TileConfig, chain_arguments, conv_program, output_hw

__all__ = ["hopper_program", "pixel_box", "default_config", "candidate_configs", "launch",
           "gluon_kernel", "hopper_reason", "HopperConvKernel"]


def hopper_program(region: Region, device: torch.device) -> ConvProgram | str:
    """The kernel's arguments for ``region`` (a :class:`~.conv.ConvProgram`), or why the kernel
    cannot run it (a text): :func:`~.conv.conv_program`'s conditions, stride 1 (or 2 on an
    image of even height and width), dilation 1 and a multiple of 16 input channels."""
    program = conv_program(region, device)
    if isinstance(program, str):
        return program
    if program.stride not in ((1, 1), (2, 2)) or program.dilation != (1, 1):
        return (f"stride {program.stride} and dilation {program.dilation}; the Hopper kernel "
                "takes stride 1 or 2 and dilation 1")
    c = region.conv.args[1].meta["val"].shape[1]
    if c % 16:
        return f"{c} input channels; the Hopper kernel takes a multiple of 16"
    h, w = region.conv.args[0].meta["val"].shape[2:]
    if program.stride == (2, 2) and (h % 2 or w % 2):
        return f"stride 2 on a {h}x{w} image; the Hopper kernel takes even sizes there"
    return program


def pixel_box(bm: int, n: int, ho: int, wo: int) -> tuple[int, int, int]:
    """``(images, rows, columns)`` of a tile of ``bm`` output pixels (a power of two) over
    ``n`` images of ``ho`` x ``wo``: whole rows where they fit (columns: the next power of two
    of ``wo``, at most ``bm``), then rows, then images."""
    cols = min(next_power_of_two(wo), bm)
    rows = min(next_power_of_two(ho), bm // cols)
    return bm // (rows * cols), rows, cols


def default_config(m: int, k: int, c: int) -> TileConfig:
    """The launch configuration for ``m`` output pixels, ``k`` output and ``c`` input channels:
    64 pixels by up to 128 channels (64 when that leaves fewer than 132 programs, an H100's
    SMs), the widest of 64, 32 and 16 input channels per step that divides ``c``, 3 stages and
    4 warps. A heuristic: the first of :func:`candidate_configs`, the one taken untimed."""
    bk = next(b for b in (64, 32, 16) if c % b == 0)
    bn = min(128, max(16, next_power_of_two(k)))
    if bn == 128 and -(-m // 64) * -(-k // 128) < 132:
        bn = 64
    return TileConfig(64, bn, bk, warps=4, stages=3)


def candidate_configs(m: int, k: int, c: int) -> list[TileConfig]:
    """The configurations autotuning times: :func:`default_config` first, then 64 and 128 pixel
    tiles by 64 and 128 channels, 3 and 4 stages, each clamped to the shape; 8 warps for a
    128 x 128 tile, else 4."""
    first = default_config(m, k, c)
    found = [first]
    for bm, bn, stages in ((64, 64, 4), (128, 64, 3), (64, 128, 3), (128, 128, 3)):
        bn = min(bn, max(16, next_power_of_two(k)))
        config = TileConfig(bm, bn, first.bk, warps=8 if bm * bn >= 128 * 128 else 4,
                            stages=stages)
        if config not in found:
            found.append(config)
    return found


@functools.cache
def gluon_kernel() -> Any:
    """The Gluon kernel module (:mod:`.conv_hopper_gluon`), compiled per configuration on
    first use; ``None`` when Triton or its Gluon dialect does not import."""
    def load() -> Any:
        from . import conv_hopper_gluon  # noqa: PLC0415  (imports triton's gluon)
        return conv_hopper_gluon

    return load_kernel("conv_wgmma", load)


def hopper_reason() -> str:
    """Why the kernel cannot run here (``""``: it can): CUDA, a GPU of compute capability 9.0
    (Hopper: H100, H200) and Triton's Gluon dialect."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        major, minor = torch.cuda.get_device_capability()
        return f"the GPU has compute capability {major}.{minor}; the Hopper kernel needs 9.0"
    return triton_unavailable(gluon_kernel)


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor may address ``t`` as it is: 16-byte aligned start and strides,
    its last dimension contiguous."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(
        st * size % 16 == 0 for st in t.stride()[:-1])


def launch(kernels: Any, x: torch.Tensor, weight: torch.Tensor,
           operands: Sequence[torch.Tensor], program: ConvProgram,
           config: TileConfig | None = None) -> list[torch.Tensor]:
    """Run ``kernels`` (:func:`gluon_kernel`) on ``x`` ``[N, C, H, W]``, ``weight``
    ``[K, C, R, S]`` (channels_last; else converted here) and the epilogue's ``operands``;
    returns one channels_last ``[N, K, HO, WO]`` tensor of ``x.dtype`` per ``program.outputs``
    entry."""
    from triton.experimental.gluon import language as gl  # noqa: PLC0415
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

    nhwc = x.permute(0, 2, 3, 1)
    stride = program.stride[0]
    n, h, w, c = nhwc.shape
    if not _tma_ready(nhwc) or (stride == 2 and nhwc.stride(2) != c):
        nhwc = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
    if stride == 2:  # [N, H/2, 2, W/2, 2C]: a tap's rows and columns of one parity, as a box
        nhwc = nhwc.reshape(n, h // 2, 2, w // 2, 2 * c)
    k, _, r, s = weight.shape
    matrix = weight.permute(0, 2, 3, 1).reshape(k, r * s * c)  # a view of channels_last
    if not _tma_ready(matrix):
        matrix = matrix.contiguous()
    ho, wo = output_hw(h, w, r, s, program)
    config = config or default_config(n * ho * wo, k, c)
    images, rows, cols = pixel_box(config.bm, n, ho, wo)
    ys = [torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last) for _ in program.outputs]
    pointers, chain = chain_arguments(program, operands, weight)
    swizzle = min(128, 2 * config.bk)
    box = [images, rows, cols, config.bk] if stride == 1 else [images, rows, 1, cols, config.bk]
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16,
                                    rank=len(box))
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
    x_desc = TensorDescriptor(nhwc, list(nhwc.shape), list(nhwc.stride()), box, x_layout)
    w_desc = TensorDescriptor(matrix, list(matrix.shape), list(matrix.stride()),
                              [config.bn, config.bk], w_layout)
    grid = (-(-n // images) * -(-ho // rows) * -(-wo // cols), -(-k // config.bn))
    kernels.conv_wgmma_kernel[grid](
        x_desc, w_desc, ys[0], ys[-1], *pointers, n, ho, wo, c, k, R=r, S=s,
        PH=program.padding[0], PW=program.padding[1], STRIDE=stride, CB=c // config.bk,
        STAGES=config.stages,
        EPI_N=min(32, config.bn // 8), **chain, num_warps=config.warps)
    return ys


class HopperConvKernel(ConvKernel):
    """A region's Hopper kernel: :func:`launch` on the region's inputs in its order, with the
    calling conventions of :class:`~.conv.ConvKernel` (directly, or through ``run_region`` when
    traced; nothing launched in a dry run; off CUDA :func:`~.conv.conv_reference` runs)."""

    kernels = staticmethod(gluon_kernel)
    launch = staticmethod(launch)
