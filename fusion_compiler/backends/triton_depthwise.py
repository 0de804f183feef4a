"""The ``triton_depthwise`` backend: a region whose convolution is depthwise (one group per
channel) runs as this package's depthwise kernel (:mod:`fusion_compiler.kernels.depthwise`), for
inference. Among the default backends: cuDNN takes these regions too, so lowering times both on
the region's shapes and keeps the faster (:func:`fusion_compiler.lowering.lower`), the choice
stored in the plan cache. Tuning, the plan-cache record of the launch configuration and the
declines are those of the ``triton_conv`` backend (:class:`~.triton.TritonConvBackend`).

Training regions are declined (they stay on cuDNN, whose backward they use): the kernel has no
backward of its own yet, and a forward chosen by forward time alone would leave the step's
larger half where it is.
"""

from __future__ import annotations

from ..ir.ops import node_device
from ..ir.region import Region
from ..kernels.conv import ConvProgram, TileConfig
from ..kernels.depthwise import (DepthwiseKernel, candidate_configs, default_config,
                                 depthwise_program, triton_reason)
from .triton import TritonConvBackend

__all__ = ["TritonDepthwiseBackend"]


class TritonDepthwiseBackend(TritonConvBackend):
    """The depthwise kernel (module docstring); the arguments of
    :class:`~.triton.TritonConvBackend`."""

    name = "triton_depthwise"
    record = "triton_depthwise"
    kernel_class = DepthwiseKernel
    timing_name = "triton depthwise"
    trains = False
    explains = False

    def program(self, region: Region) -> ConvProgram | str:
        return depthwise_program(region, node_device(region.conv))

    def kernel_reason(self) -> str:
        return triton_reason()

    def configs(self, m: int, k: int, c: int, taps: int, timed: bool) -> list[TileConfig]:
        return candidate_configs(m, k) if timed else [default_config(m, k)]

    def describe(self, config: TileConfig | None = None, ops: int = 0) -> str:
        if config is None:
            return "Triton depthwise convolution"
        return f"depthwise convolution + {ops} epilogue ops, Triton ({self.label(config)})"

    def label(self, config: TileConfig) -> str:
        return f"{config.bm}x{config.bn}/{config.warps}w"
