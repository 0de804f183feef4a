"""A convolution of a small image as one dense GEMM (cuBLAS), its leading affine epilogue folded
into the GEMM's weight and bias.

For an image of ``H x W`` pixels the convolution is a linear map from a sample's ``H*W*C`` values
to its output's ``HO*WO*K`` values. On channels_last tensors these are the rows of ``x`` viewed as
``[N, H*W*C]`` and of ``y`` viewed as ``[N, HO*WO*K]`` (no copy), so ``y = x @ D`` with the dense
weight ``D`` ``[H*W*C, HO*WO*K]``: ``D[(p, q, c), (i, j, k)] = w[k, c, r, s]`` where ``p = i*sh -
ph + r*dh`` and ``q = j*sw - pw + s*dw`` (zero where no tap connects the two pixels). The GEMM does
``H*W / (R*S)`` of the implicit GEMM's nominal multiply-adds (``N*HO*WO*K*C*R*S``), because taps
that fall on the zero padding are not computed: 4/9 for a 3x3 convolution of a 2x2 image. Where
that ratio is small, cuBLAS's GEMM beats cuDNN's convolution (measurements: docs/decisions.md,
"Small images as one dense GEMM").

The region's epilogue (:func:`~fusion_compiler.kernels.conv.conv_program`) is split in two: its
leading ops that are an affine map per output channel (add, sub, mul, div with a scalar or a
per-channel operand) and one ReLU after them are folded into the GEMM (the columns of ``D`` scaled,
a bias vector of ``HO*WO*K`` values, cuBLASLt's bias and ReLU epilogues through
``torch.addmm`` / ``torch._addmm_activation``); the ops after them run as torch ops. ``D`` and the
bias are made once per version of the weight and of the folded operands
(:class:`~fusion_compiler.runtime.weight_cache.WeightCache`).

An image in another layout is copied to a packed channels_last tensor first (``reshape`` of its
NHWC view): so is a channel view of a wider tensor (a horizontally fused convolution's output,
:mod:`fusion_compiler.passes.pre_fusion.horizontal`), which timed faster than reading the view in
place with zero rows in ``D`` for the other channels (measurements: docs/decisions.md,
"Horizontal fusion of sibling convolutions").

Numerics: the folded scale is rounded into the fp16/bf16 weight (one rounding per weight value),
and the GEMM's output is rounded once before any op left unfolded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..ir.region import Region
from ..runtime.region_op import (channels_last_specs, in_dry_run, is_traced, register_kernel,
                                  run_region)
from ..runtime.derive import Expr, NotDerivable
from ..runtime.weight_cache import WeightCache
from .conv import ConvProgram, conv_program, output_hw
from .epilogue import ADD, BINARY, DIV, MUL, RELU, SUB, reference_outputs

__all__ = ["MAX_DENSE_BYTES", "DenseProgram", "small_image", "dense_program", "folded_ops",
           "dense_weight", "fold_affine", "DenseConvKernel"]

MAX_DENSE_BYTES = 32 << 20
"""Largest dense weight ``D`` taken, in bytes (it is held for as long as the kernel is)."""

_AFFINE = {ADD, SUB, MUL, DIV}
_SCALAR, _CHANNEL = 0, 1  # ConvProgram.kinds


@dataclass(frozen=True)
class DenseProgram:
    """What :class:`DenseConvKernel` computes for a region: its :class:`ConvProgram`, the
    number of leading epilogue ops folded into the GEMM (``folded``, the ReLU included), whether a
    ReLU is among them, and the shapes: image ``(H, W, C)``, output ``(HO, WO, K)``."""

    conv: ConvProgram
    folded: int
    relu: bool
    image: tuple[int, int, int]
    output: tuple[int, int, int]

    @property
    def dense_shape(self) -> tuple[int, int]:
        """``D``'s ``[H*W*C, HO*WO*K]``."""
        (h, w, c), (ho, wo, k) = self.image, self.output
        return h * w * c, ho * wo * k


def small_image(region: Region) -> bool:
    """Whether ``region``'s convolution is 2-d on an image of no more pixels than its filter has
    taps (``H*W <= R*S``): the dense GEMM then does at most the convolution's nominal work. A
    1x1 filter is no such case: its convolution is a GEMM already (``D`` would be its weight,
    with nothing skipped), which cuDNN runs."""
    x, w = region.conv.args[0], region.conv.args[1]
    if not all(hasattr(v, "meta") and "val" in v.meta for v in (x, w)):
        return False
    x, w = x.meta["val"], w.meta["val"]
    taps = w.shape[2] * w.shape[3] if w.dim() == 4 else 0
    return x.dim() == 4 and 1 < taps and x.shape[2] * x.shape[3] <= taps


def dense_program(region: Region, device: torch.device) -> DenseProgram | str:
    """The dense GEMM's arguments for ``region``, or why it does not take the region (a text):
    the convolution and epilogue as :func:`~fusion_compiler.kernels.conv.conv_program` takes them
    (fp16 or bf16, groups 1, no prologue), a GEMM of no more multiply-adds than the convolution's
    nominal ones (``H*W <= R*S``), ``D`` of at most :data:`MAX_DENSE_BYTES`, and no region output
    inside the folded ops (the GEMM does not produce them)."""
    if not small_image(region):
        return "the image has more pixels than the filter has taps, or the filter is 1x1"
    program = conv_program(region, device)
    if isinstance(program, str):
        return program
    x = region.conv.args[0].meta["val"]
    _, c, h, wd = x.shape
    _, k, ho, wo = region.conv.meta["val"].shape
    size = h * wd * c * ho * wo * k * x.element_size()
    if size > MAX_DENSE_BYTES:
        return f"the dense weight would take {size >> 20} MiB (at most {MAX_DENSE_BYTES >> 20})"
    folded, relu = folded_ops(program.ops, program.kinds)
    if min(program.outputs) < folded:
        return "a region output is a value inside the epilogue folded into the GEMM"
    return DenseProgram(program, folded, relu, (h, wd, c), (ho, wo, k))


def folded_ops(ops: Sequence[int], kinds: Sequence[int]) -> tuple[int, bool]:
    """How many leading epilogue ``ops`` (codes; ``kinds``: per binary op, 0 scalar, 1 per
    channel, 2 full) fold into the GEMM, and whether a ReLU is among them: affine ops with a
    scalar or per-channel operand, then at most one ReLU."""
    folded, relu, kinds = 0, False, iter(kinds)
    for code in ops:
        if code in BINARY:
            if code not in _AFFINE or next(kinds) not in (_SCALAR, _CHANNEL) or relu:
                break
        elif code != RELU or relu:
            break
        else:
            relu = True
        folded += 1
    return folded, relu


def dense_weight(weight: torch.Tensor, image: tuple[int, int], program: ConvProgram
                 ) -> torch.Tensor:
    """``D`` ``[H*W*C, HO*WO*K]`` (module docstring) for ``weight`` ``[K, C, R, S]`` on an
    ``image`` of ``(H, W)`` pixels, in ``weight``'s dtype (every entry a weight value or 0: a
    rearrangement, which also describes ``D`` for a derivation, :mod:`fusion_compiler.runtime.
    derive`)."""
    k, c, r, s = weight.shape
    h, w = image
    (sh, sw), (ph, pw), (dh, dw) = program.stride, program.padding, program.dilation
    ho, wo = output_hw(h, w, r, s, program)
    taps = weight.detach().permute(2, 3, 1, 0)  # [R, S, C, K]
    dense = weight.new_zeros((h, w, c, ho, wo, k))
    for i in range(ho):
        for j in range(wo):
            for a in range(r):
                p = i * sh - ph + a * dh
                for b in range(s):
                    q = j * sw - pw + b * dw
                    if 0 <= p < h and 0 <= q < w:
                        dense[p, q, :, i, j, :] = taps[a, b]
    return dense.view(h * w * c, ho * wo * k)


def fold_affine(codes: Sequence[int], operands: Sequence[torch.Tensor], channels: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map ``v -> v * scale + shift`` per output channel (fp32 ``[K]`` each) that the
    ops ``codes`` (add, sub, mul, div; ReLU codes skipped) with ``operands`` (one element or
    ``K`` values each) apply in turn."""
    device = operands[0].device if operands else None
    scale = torch.ones(channels, dtype=torch.float32, device=device)
    shift = torch.zeros(channels, dtype=torch.float32, device=device)
    it = iter(operands)
    for code in codes:
        if code not in BINARY:
            continue
        v = next(it).detach().float().reshape(-1).expand(channels)
        if code == MUL:
            scale, shift = scale * v, shift * v
        elif code == DIV:
            scale, shift = scale / v, shift / v
        else:
            shift = shift + v if code == ADD else shift - v
    return scale, shift


class DenseConvKernel:
    """A region's kernel: ``x`` ``[N, C, H, W]`` (channels_last; another layout is converted)
    times ``D`` with the folded epilogue in one cuBLAS call, then the ops left, on the region's
    inputs in its order; returns the region's outputs, channels_last ``[N, K, HO, WO]`` of
    ``x.dtype``. Called directly, or through
    :func:`~fusion_compiler.runtime.region_op.run_region` (one opaque op) when its inputs are
    being traced; in a :func:`~fusion_compiler.runtime.region_op.dry_run` it returns
    uninitialized outputs and runs nothing.

    Args:
        program: the region's :class:`DenseProgram`.
        outputs: ``(shape, dtype)`` of each region output.
        name: what tells this kernel apart from the others of its graph (the region's id), part
            of its ``run_region`` key.
    """

    def __init__(self, program: DenseProgram,
                 outputs: Sequence[tuple[tuple[int, ...], torch.dtype]], name: str = ""):
        self.program = program
        self.folded_operands = sum(code in BINARY for code in program.conv.ops[:program.folded])
        self.weights = WeightCache(self._prepare, describe=self._describe)
        self.key = register_kernel(self, channels_last_specs(outputs), f"{name} dense")

    def _describe(self, weight: Expr, *operands: Expr) -> tuple[Expr, Expr]:
        """What :meth:`_prepare` makes, as expressions of its inputs' (a derivation scope
        recomputes them on the GPU when the weight or a folded operand changes).

        Raises:
            NotDerivable: the folded ops make the scale or the shift other than a product of
                at most one operand each (a division, an add before a multiply)."""
        program = self.program
        ho, wo, k = program.output
        scale, shift = Expr.constant(1.0, (k,)), None
        it = iter(operands)
        for code in program.conv.ops[:program.folded]:
            if code not in BINARY:
                continue
            v = Expr.rearranged(lambda a: a.reshape(-1).expand(k), next(it))
            if code == MUL:
                scale = scale.times(v)
                if shift is not None:
                    shift = shift.times(v)
            elif code in (ADD, SUB) and shift is None:
                shift = v if code == ADD else v.scaled(-1.0)
            else:
                raise NotDerivable("a division or a second add among the folded ops")
        columns = Expr.rearranged(lambda a: a.repeat(ho * wo), scale)
        dense = Expr.rearranged(lambda a: dense_weight(a, program.image[:2], program.conv),
                                weight).times(Expr.rearranged(lambda a: a.expand(
                                    program.dense_shape), columns))
        bias = (Expr.constant(0.0, (ho * wo * k,)) if shift is None
                else Expr.rearranged(lambda a: a.repeat(ho * wo), shift))
        return dense, bias

    def _prepare(self, weight: torch.Tensor, *operands: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``D`` with the folded scale, and the bias vector, in the weight's dtype."""
        program = self.program
        ho, wo, k = program.output
        scale, shift = fold_affine(program.conv.ops[:program.folded], operands, k)
        dense = dense_weight(weight, program.image[:2], program.conv)
        dense = (dense * scale.to(dense.device).repeat(ho * wo)).to(weight.dtype)
        return dense, shift.to(dense.device).repeat(ho * wo).to(weight.dtype)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        program, conv = self.program, self.program.conv
        x = inputs[conv.image_at]
        n = x.shape[0]
        ho, wo, k = program.output
        if in_dry_run():
            return tuple(torch.empty((n, k, ho, wo), dtype=x.dtype, device=x.device,
                                     memory_format=torch.channels_last) for _ in conv.outputs)
        operands = [inputs[o] if isinstance(o, int) else o for o in conv.operands]
        dense, bias = self.weights(inputs[conv.weight_at], *operands[:self.folded_operands])
        rows = x.permute(0, 2, 3, 1).reshape(n, -1)  # a view when x is packed channels_last
        y = (torch._addmm_activation(bias, rows, dense) if program.relu
             else torch.addmm(bias, rows, dense))
        y = y.view(n, ho, wo, k).permute(0, 3, 1, 2)
        rest = conv.ops[program.folded:]
        stages = [o - program.folded for o in conv.outputs]
        if not rest:
            return tuple(y for _ in stages)
        return tuple(reference_outputs(y.float(), rest, operands[self.folded_operands:], stages,
                                       x.dtype))

    def call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What graphs call: the kernel directly, or the ``run_region`` op when traced."""
        if is_traced(inputs[0]):
            return tuple(run_region(self.key, list(inputs)))
        return self(*inputs)
