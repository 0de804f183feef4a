"""The ``hopper_conv`` backend: a region whose convolution and epilogue
:func:`fusion_compiler.kernels.conv_hopper.hopper_program` takes (stride 1 or 2, dilation 1, a
multiple of 16 input channels, fp16 or bf16) runs as this package's Hopper kernel (TMA loads and
wgmma, :mod:`fusion_compiler.kernels.conv_hopper`), for inference on a GPU of compute capability
9.0. cuDNN takes these regions too, so where both are asked lowering times both kernels on the
region's shapes and keeps the faster (:func:`fusion_compiler.lowering.lower`), the choice stored in
the plan cache. Tuning, the plan-cache record of the tile configuration and the declines are those
of the ``triton_conv`` backend (:class:`~.triton.TritonConvBackend`).

Not among the default backends yet: ``backends=("triton_stem", "dense", "triton_depthwise",
"hopper_conv", "cudnn")`` asks it (docs/decisions.md, "Hopper convolutions"). Training regions
are declined (they stay on cuDNN, whose backward they use), as are regions on other GPUs,
without a reason in the report: the regions are cuDNN's to explain.
"""

from __future__ import annotations

from ..ir.ops import node_device
from ..ir.region import Region
from ..kernels.conv import ConvProgram, TileConfig
from ..kernels.conv_hopper import (HopperConvKernel, candidate_configs, default_config,
                                   hopper_program, hopper_reason)
from .triton import TritonConvBackend

__all__ = ["HopperConvBackend"]


class HopperConvBackend(TritonConvBackend):
    """The Hopper kernel (module docstring); the arguments of
    :class:`~.triton.TritonConvBackend`."""

    name = "hopper_conv"
    record = "hopper_conv"
    kernel_class = HopperConvKernel
    timing_name = "hopper"
    trains = False
    explains = False

    def program(self, region: Region) -> ConvProgram | str:
        return hopper_program(region, node_device(region.conv))

    def kernel_reason(self) -> str:
        return hopper_reason()

    def configs(self, m: int, k: int, c: int, taps: int, timed: bool) -> list[TileConfig]:
        return candidate_configs(m, k, c) if timed else [default_config(m, k, c)]

    def describe(self, config: TileConfig | None = None, ops: int = 0) -> str:
        if config is None:
            return "Hopper convolution"
        return f"TMA + wgmma convolution + {ops} epilogue ops, Gluon ({self.label(config)})"

    def label(self, config: TileConfig) -> str:
        return f"{config.bm}x{config.bn}x{config.bk}/{config.warps}w{config.stages}s"
