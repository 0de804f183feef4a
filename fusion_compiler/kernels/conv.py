"""A region's forward convolution and its epilogue as one Triton implicit-GEMM kernel.

The kernel (:mod:`.conv_triton`) computes ``conv2d(x, w, None, stride, padding, dilation, 1)`` for
fp16 or bf16 ``x`` ``[N, C, H, W]`` and ``w`` ``[K, C, R, S]`` (any filter size, stride,
padding and dilation; any channel counts: ragged ones are masked, not padded), accumulates in
fp32 on tensor cores (``tl.dot``), applies the region's epilogue to the fp32 value (up to
:data:`MAX_STEPS` ops: add, sub, mul, div with a scalar, per-channel or full operand; ReLU,
sigmoid, tanh, SiLU, ``clamp(x, 0, c)``) and writes up to :data:`MAX_OUTPUTS` values of the
chain channels_last, each rounded once, as cuDNN's fp32 intermediates are. ``x`` may have any
strides (an input not channels_last is converted first); the weight is read channels_last
(converted once per weight version, :class:`~fusion_compiler.runtime.weight_cache.WeightCache`).

The region-level pieces: :func:`conv_program` reads a region into the kernel's arguments (or says
why it cannot), :class:`ConvKernel` is what the ``triton_conv`` backend
(:mod:`fusion_compiler.backends.triton`) lowers a region to, and :func:`conv_reference` is the
same computation as torch ops (an fp64 oracle for fp64 inputs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.ops import int_pair
from ..ir.region import Region
from ..runtime.region_op import (channels_last_specs, in_dry_run, is_traced, register_kernel,
                                  run_region)
from ..runtime.weight_cache import WeightCache
from . import load_kernel, triton_unavailable
from .epilogue import (BINARY, WITH_CLAMP, WITH_OPERAND, binary_operand, epilogue_chain,
                       reference_outputs)

__all__ = ["MAX_STEPS", "MAX_OUTPUTS", "ConvProgram", "TileConfig", "conv_program",
           "output_hw", "conv_reference", "SMS", "default_config", "candidate_configs", "launch",
           "triton_kernel", "triton_reason", "chain_arguments", "ConvKernel", "SCALAR", "CHANNEL",
           "FULL"]

MAX_STEPS = 6
"""Most epilogue ops after the convolution."""
MAX_OUTPUTS = 2
"""Most region outputs (values of the chain: the convolution's or any epilogue op's)."""

SCALAR, CHANNEL, FULL = range(3)
"""Operand kinds, as the kernel's ``KIND*`` constexprs take them: one element, one value per
output channel, a full channels_last tensor."""
_KINDS = {"scalar": SCALAR, "channel": CHANNEL, "full": FULL}
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ConvProgram:
    """What the kernel computes for a region, by position in the region's inputs.

    ``operands``: per binary op of ``ops``, the position of its region input or a one-element
    fp32 tensor (a number of the graph); ``kinds``: per binary op, 0 scalar, 1 per channel
    (``[1, K, 1, 1]``), 2 full (``[N, K, HO, WO]``); ``ops``: op codes; ``outputs``: 0 the
    convolution's value, ``i`` the value after ``ops[i - 1]``. ``stride``, ``padding``,
    ``dilation``: ``(h, w)`` pairs of the convolution."""

    image_at: int
    weight_at: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    operands: tuple[int | torch.Tensor, ...]
    kinds: tuple[int, ...]
    ops: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: ``bm`` output pixels by ``bn`` output channels per program,
    ``bk`` input channels per reduction step, ``group`` row tiles that share column tiles,
    ``warps``, pipeline ``stages`` and ``split``: programs per output tile, each reducing a share
    of the taps and channels (split-K; above 1 the partial sums go through an fp32 workspace of
    ``4 * M * K`` bytes and a second kernel runs the epilogue)."""

    bm: int
    bn: int
    bk: int
    group: int = 8
    warps: int = 4
    stages: int = 3
    split: int = 1


def _geometry(conv: fx.Node, depthwise: bool = False) -> tuple[tuple[int, int], ...] | str:
    """``(stride, padding, dilation)`` of a canonical ``conv2d`` node, or why not taken: groups
    must be 1, or with ``depthwise`` the input's channel count, each group one output channel."""
    if len(conv.args) != 7 or conv.kwargs:
        return "the convolution is not in canonical form"
    _, _, bias, stride, padding, dilation, groups = conv.args
    if bias is not None:
        return "the convolution has a bias input (the canonical form adds it in the epilogue)"
    if depthwise:
        c, k = conv.args[0].meta["val"].shape[1], conv.args[1].meta["val"].shape[0]
        if not (groups == c == k and conv.args[1].meta["val"].shape[1] == 1):
            return (f"not a depthwise convolution ({groups} groups, {c} input and {k} output "
                    "channels; the kernel takes one group per channel)")
    elif groups != 1:
        return f"a grouped convolution ({groups} groups); the kernel takes groups=1"
    pairs = tuple(int_pair(v) for v in (stride, padding, dilation))
    if None in pairs:
        return f"stride {stride}, padding {padding}, dilation {dilation} are not pairs of ints"
    return pairs


def conv_program(region: Region, device: torch.device, depthwise: bool = False
                 ) -> ConvProgram | str:
    """The kernel's arguments for ``region`` (numbers of the graph become one-element fp32
    tensors on ``device``), or why the kernel cannot run it (a text). ``depthwise``: the
    region's convolution must be depthwise (:mod:`.depthwise`), else ungrouped."""
    names = [n.name for n in region.graph_module.graph.find_nodes(op="placeholder")]
    conv = region.conv
    image, weight = conv.args[0], conv.args[1]
    if not all(isinstance(v, fx.Node) and v.op == "placeholder" for v in (image, weight)):
        return "the convolution's input or weight is computed in the region (a prologue)"
    x, w = image.meta["val"], weight.meta["val"]
    if x.dim() != 4 or w.dim() != 4:
        return "not a 2-d convolution on a 4-d input"
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        return f"dtypes {x.dtype} and {w.dtype}; the kernel takes float16 or bfloat16"
    geometry = _geometry(conv, depthwise)
    if isinstance(geometry, str):
        return geometry
    chain = epilogue_chain(region, WITH_CLAMP, BINARY, MAX_STEPS, MAX_OUTPUTS, prologue=False)
    if isinstance(chain, str):
        return chain
    steps, outputs = chain
    operands, kinds = [], []
    for step in steps:
        if step.code in WITH_OPERAND:
            operand = binary_operand(step, region, _KINDS, device)
            if operand is None:
                return (f"{step.node.name}'s operand is not a number, a per-channel or a full "
                        "tensor")
            operands.append(operand[0])
            kinds.append(_KINDS[operand[1]])
    ops = [step.code for step in steps]
    stride, padding, dilation = geometry
    return ConvProgram(names.index(image.name), names.index(weight.name), stride, padding,
                       dilation, tuple(operands), tuple(kinds), tuple(ops), tuple(outputs))


def output_hw(h: int, w: int, r: int, s: int, program: ConvProgram) -> tuple[int, int]:
    """``(HO, WO)`` of ``program``'s convolution with an ``r`` x ``s`` filter of an ``h`` x ``w``
    image."""
    (sh, sw), (ph, pw), (dh, dw) = program.stride, program.padding, program.dilation
    return (h + 2 * ph - dh * (r - 1) - 1) // sh + 1, (w + 2 * pw - dw * (s - 1) - 1) // sw + 1


def conv_reference(x: torch.Tensor, weight: torch.Tensor, operands: Sequence[torch.Tensor],
                   program: ConvProgram) -> list[torch.Tensor]:
    """The kernel's computation as torch ops: the convolution and epilogue in fp32 (fp64 for
    fp64 inputs: an oracle), each requested value rounded to ``x.dtype`` once, channels_last.
    ``operands``: the tensors of ``program.operands``, in order."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = F.conv2d(x.to(acc), weight.to(acc), None, program.stride, program.padding,
                 program.dilation)
    return reference_outputs(y, program.ops, operands, program.outputs, x.dtype)


SMS = 132
"""Streaming multiprocessors of an H100 SXM, the GPU the tile heuristics were chosen for."""


def default_config(m: int, k: int, c: int) -> TileConfig:
    """The launch configuration for ``m`` output pixels, ``k`` output channels and ``c`` input
    channels: 128 by 128 tiles (8 warps) where the grid still fills an H100's 132 SMs, else 64
    pixels per tile; input channels in chunks of 64 (fewer for thinner inputs). A heuristic: the
    first of :func:`candidate_configs`, and the one taken untimed (``autotune <= 1``)."""
    bn = min(128, max(16, 1 << (k - 1).bit_length()))
    bk = min(64, max(16, 1 << (c - 1).bit_length()))
    tiles_n = -(-k // bn)
    bm = 128 if -(-m // 128) * tiles_n >= SMS else 64
    return TileConfig(bm, bn, bk, warps=8 if bm * bn >= 128 * 128 else 4)


def candidate_configs(m: int, k: int, c: int, taps: int = 9) -> list[TileConfig]:
    """The configurations autotuning times for ``m`` output pixels, ``k`` output channels, ``c``
    input channels and ``taps`` filter taps (``R * S``): :func:`default_config` first, then 64
    and 128 tiles, 32 and 64 input channels per step, 3 to 5 stages, each clamped to the shape
    (no tile wider than the next power of two of its dimension, none below Triton's 16 for
    ``tl.dot``); where 64-by-128 tiles leave most of :data:`SMS` idle, the same split 2 and 4
    ways (split-K), each share at least 4 reduction steps."""
    pow2 = lambda v: max(16, 1 << (v - 1).bit_length())  # noqa: E731
    found = [default_config(m, k, c)]
    for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4),
                                      (64, 128, 64, 4, 4), (64, 64, 32, 4, 5)):
        config = TileConfig(min(bm, pow2(m)), min(bn, pow2(k)), min(bk, pow2(c)), warps=warps,
                            stages=stages)
        if config not in found:
            found.append(config)
    bm, bn, bk = min(64, pow2(m)), min(128, pow2(k)), min(64, pow2(c))
    tiles, steps = -(-m // bm) * -(-k // bn), taps * -(-c // bk)
    for split in (2, 4):
        if tiles * split <= 2 * SMS and steps >= 4 * split:
            found.append(TileConfig(bm, bn, bk, stages=4, split=split))
    return found


@functools.cache
def triton_kernel() -> Any:
    """The Triton kernels (the module :mod:`.conv_triton`: ``conv_nhwc_kernel`` and, for
    split-K, ``conv_epilogue_kernel``), compiled per configuration on first use; ``None`` when
    Triton does not import."""
    def load() -> Any:
        from . import conv_triton  # noqa: PLC0415  (imports triton)
        return conv_triton

    return load_kernel("conv_nhwc", load)


def triton_reason() -> str:
    """Why the kernel cannot run here (``""``: it can): Triton must import and CUDA must be
    available."""
    return triton_unavailable(triton_kernel)


def launch(kernels: Any, x: torch.Tensor, weight: torch.Tensor,
           operands: Sequence[torch.Tensor], program: ConvProgram,
           config: TileConfig | None = None) -> list[torch.Tensor]:
    """Run ``kernels`` (:func:`triton_kernel`, or the module interpreted in tests) on ``x``
    ``[N, C, H, W]`` (converted to channels_last unless its channels are the innermost dimension
    already), ``weight`` ``[K, C, R, S]`` (any strides) and the binary ops' ``operands``; returns
    one channels_last ``[N, K, HO, WO]`` tensor of ``x.dtype`` per ``program.outputs`` entry."""
    if x.stride(1) != 1:
        x = x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    k, _, r, s = weight.shape
    ho, wo = output_hw(h, w, r, s, program)
    m = n * ho * wo
    config = config or default_config(m, k, c)
    ys = [torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last) for _ in program.outputs]
    pointers, chain = chain_arguments(program, operands, weight)
    (sh, sw), (ph, pw), (dh, dw) = program.stride, program.padding, program.dilation
    tiles = -(-m // config.bm) * -(-k // config.bn)
    ws = (torch.zeros((m, k), dtype=torch.float32, device=x.device) if config.split > 1
          else ys[0])  # not written without split-K
    kernels.conv_nhwc_kernel[(tiles * config.split,)](
        x, weight, ys[0], ys[-1], *pointers, ws, m, *x.stride(), *weight.stride(),
        C=c, H=h, W=w, K=k, HO=ho, WO=wo, R=r, S=s, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw,
        BM=config.bm, BN=config.bn, BK=config.bk, GROUP=config.group, SPLIT=config.split,
        **chain, num_warps=config.warps, num_stages=config.stages)
    if config.split > 1:
        kernels.conv_epilogue_kernel[(tiles,)](
            ws, ys[0], ys[-1], *pointers, m, K=k, BM=config.bm, BN=config.bn, **chain,
            num_warps=4)
    return ys


def chain_arguments(program: ConvProgram, operands: Sequence[torch.Tensor],
                    unread: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, int]]:
    """The epilogue's kernel arguments: one pointer per op slot (:data:`MAX_STEPS`; an
    operand, made contiguous in the layout its kind reads, or ``unread`` where the op takes
    none) and the constexprs ``OP*``, ``KIND*``, ``OUT0``, ``OUT1``."""
    codes = [*program.ops, *[0] * (MAX_STEPS - len(program.ops))]
    pointers, kinds, it, kit = [], [], iter(operands), iter(program.kinds)
    for code in codes:
        if code in WITH_OPERAND:
            t, kind = next(it), next(kit)
            pointers.append(t.contiguous(memory_format=torch.channels_last) if kind == 2
                            else t.reshape(-1).contiguous())
            kinds.append(kind)
        else:
            pointers.append(unread)
            kinds.append(0)
    stages = [*program.outputs, *[-1] * (MAX_OUTPUTS - len(program.outputs))]
    return pointers, {**{f"OP{i}": code for i, code in enumerate(codes)},
                      **{f"KIND{i}": kind for i, kind in enumerate(kinds)},
                      "OUT0": stages[0], "OUT1": stages[1]}


class ConvKernel:
    """A region's kernel: :func:`launch` on the region's inputs in its order, called directly,
    or through :func:`~fusion_compiler.runtime.region_op.run_region` (one opaque op) when its
    inputs are being traced. In a :func:`~fusion_compiler.runtime.region_op.dry_run` it returns
    uninitialized outputs and launches nothing.

    Args:
        program: the region's :class:`ConvProgram`.
        outputs: ``(shape, dtype)`` of each region output.
        config: the launch configuration (default: :func:`default_config`).
        name: what tells this kernel apart from the others of its graph (e.g. the region's
            id), part of its ``run_region`` key.
        direct: :meth:`call` launches the kernel straight from Python (inference) unless its
            inputs are traced; ``False`` (training): always through ``run_region``, whose
            autograd formula runs the backward registered for :attr:`key`.

    A subclass runs another kernel family with the same conventions
    (:class:`~.depthwise.DepthwiseKernel`): it sets :attr:`kernels`, :attr:`launch` and
    :attr:`reference` and may override :meth:`weight`.
    """

    kernels = staticmethod(triton_kernel)
    """The Triton kernels' module, or ``None`` (the reference runs)."""
    launch = staticmethod(launch)
    """``launch(kernels, x, weight, operands, program, config)``: the outputs."""
    reference = staticmethod(conv_reference)
    """``reference(x, weight, operands, program)``: the outputs as torch ops."""

    def __init__(self, program: ConvProgram,
                 outputs: Sequence[tuple[tuple[int, ...], torch.dtype]],
                 config: TileConfig | None = None, name: str = "", direct: bool = True):
        self.program, self.config, self.direct = program, config, direct
        self.weight_cache = WeightCache()
        self.specs = channels_last_specs(outputs)
        self.key = register_kernel(self, self.specs, f"{name} {config}")

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = inputs[self.program.image_at]
        if in_dry_run():
            return tuple(torch.empty_strided(shape, stride, dtype=dtype, device=x.device)
                         for shape, stride, dtype in self.specs)
        weight = self.weight(inputs[self.program.weight_at])
        operands = [inputs[o] if isinstance(o, int) else o for o in self.program.operands]
        kernels = self.kernels() if x.is_cuda else None
        if kernels is None:
            return tuple(self.reference(x, weight, operands, self.program))
        return tuple(self.launch(kernels, x, weight, operands, self.program, self.config))

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the kernel reads it: channels_last, converted once per weight version
        (:class:`~fusion_compiler.runtime.weight_cache.WeightCache`)."""
        return self.weight_cache(weight)

    def call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What graphs call: the kernel directly, or the ``run_region`` op when traced or not
        ``direct``."""
        if self.direct and not is_traced(inputs[0]):
            return self(*inputs)
        return tuple(run_region(self.key, list(inputs)))
