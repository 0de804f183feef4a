"""One region's forward on cuDNN: its execution plan and how its inputs are fed to it.

Layouts: activations and weights are passed to cuDNN channels_last (NHWC); NCHW inputs are
converted by the kernel, outputs are channels_last. An image that is a channel view of a wider
channels_last tensor (a horizontally fused convolution's output) is read in place. When a convolution's input channel count is
not a multiple of 8 (fp16/bf16) or 4 (fp32) the image and weight are zero-padded in channels; when
its output channel count is not, inference kernels pad the weight's output channels and the
epilogue's per-channel and full operands, and copy the real channels out of the padded outputs
(:func:`.graph.output_padding`).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ...ir.ops import node_device
from ...ir.region import Region
from ...runtime.region_op import is_traced, register_kernel, run_region
from .graph import (channel_padding, image_view_total, output_dtype, output_padding,
                    padded_output, region_recipe, to_nhwc)
from ...runtime.tensors import as_channel_view
from ...runtime.weight_cache import WeightCache
from .plan import CudnnPlan, PlanBackend
from .recipe import nhwc_strides

__all__ = ["CudnnKernel"]


class CudnnKernel:
    """One region's forward: its :class:`CudnnPlan` and how to feed it.

    ``direct``: :meth:`call` runs the plan straight from Python (inference), unless its inputs
    are being traced; else through the ``fusion_compiler::run_region`` custom op (training,
    tracing), which costs more host time per call (measurements: docs/decisions.md,
    "``glue_backend="auto"`` runs eager glue for inference without a CUDA graph").
    """

    def __init__(self, backend: PlanBackend, region: Region, direct: bool = False):
        self.backend = backend
        self.region_id = region.region_id
        self.direct = direct
        placeholders = [n for n in region.graph_module.graph.nodes if n.op == "placeholder"]
        self.device = node_device(placeholders[0])
        self.plan = CudnnPlan(backend, self.device, region_recipe(region),
                              f"region {region.region_id}")

        pad = channel_padding(region)
        out_pad = output_padding(region)
        in_pads = pad[1] if pad is not None else set()
        out_pads = out_pad[1] if out_pad is not None else set()
        conv = region.conv
        self.prepare: list[Callable[[torch.Tensor], torch.Tensor]] = []
        # the convolution weight's channels_last copy, shared with the dgrad (one copy per step)
        self.weight_cache: WeightCache | None = None
        for node, op in zip(placeholders, region.operands()):
            if node is conv.args[1] and (node.name in in_pads or node.name in out_pads):
                # zero input and/or output channels, made once per weight version
                self.prepare.append(WeightCache(_weight_padder(
                    pad[0] if node.name in in_pads else None,
                    out_pad[0] if node.name in out_pads else None), rearrangement=True))
            elif node.name in in_pads:
                self.prepare.append(_padder(pad[0]))
            elif node.name in out_pads:
                self.prepare.append(_operand_padder(out_pad[0], op.role))
            elif op.role in ("scalar", "channel"):
                # [1] / [K] / [1,K,1,1] contiguous: the same memory as the declared [1,K,1,1]
                self.prepare.append(torch.Tensor.contiguous)
            elif (total := image_view_total(region, node)) is not None:
                self.prepare.append(functools.partial(as_channel_view, total=total))
            elif op.role == "weight":
                self.prepare.append(WeightCache())
                if node is region.conv.args[1]:
                    self.weight_cache = self.prepare[-1]
            else:
                self.prepare.append(to_nhwc)
        self.outputs = []  # (shape, strides, dtype cuDNN writes, dtype the region returns)
        self.padded: list[tuple[tuple[int, ...], int] | None] = []  # (shape written, channels)
        for out in region.output_nodes:
            val = out.meta["val"]
            shape = tuple(val.shape)
            self.outputs.append((shape, tuple(nhwc_strides(shape)), output_dtype(out),
                                 val.dtype))
            self.padded.append((shape[:1] + (out_pad[0],) + shape[2:], shape[1])
                               if out_pad is not None and padded_output(out, conv) else None)
        self._converts = any(written != want for _, _, written, want in self.outputs)
        self._pads_outputs = any(p is not None for p in self.padded)
        self.key = register_kernel(self, [(s, st, dt) for s, st, _, dt in self.outputs],
                                   f"region {region.region_id}")
        # what the graph around the kernel can do for it (the layout passes)
        self.nhwc_inputs = frozenset(i for i, prep in enumerate(self.prepare) if prep is to_nhwc)
        self.padded_images = {i: pad[0] for i, node in enumerate(placeholders)
                              if node.name in in_pads and node is not conv.args[1]}

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._pads_outputs:
            return self._padded_call(inputs)
        outs = tuple(torch.empty_strided(shape, stride, dtype=written, device=self.device)
                     for shape, stride, written, _ in self.outputs)
        self.plan.execute([prep(x) for prep, x in zip(self.prepare, inputs)], outs)
        if not self._converts:
            return outs
        return tuple(out if out.dtype == want else out.to(want)
                     for out, (_, _, _, want) in zip(outs, self.outputs))

    def _padded_call(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Outputs with padded channels are written at their padded size, then their first
        channels copied out in the declared layout (one copy each)."""
        outs = []
        for (shape, stride, written, _), padded in zip(self.outputs, self.padded):
            size = shape if padded is None else padded[0]
            outs.append(torch.empty_strided(size, nhwc_strides(size), dtype=written,
                                            device=self.device))
        self.plan.execute([prep(x) for prep, x in zip(self.prepare, inputs)], outs)
        result = []
        for out, (shape, stride, _, want), padded in zip(outs, self.outputs, self.padded):
            if padded is not None:
                out = torch.empty_strided(shape, stride, dtype=out.dtype,
                                          device=self.device).copy_(out[:, :padded[1]])
            result.append(out if out.dtype == want else out.to(want))
        return tuple(result)

    def call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What graphs call: the plan directly for inference, else the ``run_region`` op."""
        if self.direct and not is_traced(inputs[0]):
            return self(*inputs)
        return tuple(run_region(self.key, list(inputs)))


def _weight_padder(in_channels: int | None, out_channels: int | None
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[K,C,R,S]`` weight -> channels_last ``[K',C',R,S]`` with zero output channels up to
    ``out_channels`` and zero input channels up to ``in_channels`` (``None``: unchanged), in one
    copy."""
    def pad(w: torch.Tensor) -> torch.Tensor:
        k, c = out_channels or w.shape[0], in_channels or w.shape[1]
        krsc = F.pad(w.permute(0, 2, 3, 1), (0, c - w.shape[1], 0, 0, 0, 0, 0, k - w.shape[0]))
        return krsc.permute(0, 3, 1, 2)
    return pad


def _operand_padder(channels: int, role: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An epilogue operand with the conv's output channels -> ``channels`` channels (zeros
    after): a ``"channel"`` operand (``[K]``, ``[K,1,1]``, ``[1,K,1,1]``) as ``[1,K',1,1]``, a
    ``"full"`` one ``[N,K,P,Q]`` as channels_last ``[N,K',P,Q]``."""
    padder = _padder(channels)
    if role == "full":
        return padder
    return lambda t: padder(t.reshape(1, -1, 1, 1))


def _padder(channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """NCHW-logical tensor -> channels_last tensor zero-padded to ``channels`` channels, in one copy
    (none for a tensor that already is: the graph padded it, ``Region.padded_images``)."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == channels:  # no copy when it is channels_last already
            return t.contiguous(memory_format=torch.channels_last)
        nhwc = t.permute(0, 2, 3, 1)
        return F.pad(nhwc, (0, channels - t.shape[1])).permute(0, 3, 1, 2)
    return pad
