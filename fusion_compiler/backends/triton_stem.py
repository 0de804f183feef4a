"""The ``triton_stem`` backend: a region whose prologue is a SpaceToDepth (given it by the fusion
pass ``space_to_depth_stem``) runs as one ``fusion_compiler::space_to_depth_conv`` Triton kernel
(:mod:`fusion_compiler.kernels.space_to_depth`): SpaceToDepth, the 1x1 convolution and its
epilogue, reading the NCHW image once and writing channels_last outputs. Inference only; it
claims no other region (it declines them without a reason).
"""

from __future__ import annotations

from ..config import CompileOptions
from ..ir.errors import UnsupportedError
from ..ir.ops import node_device
from ..ir.region import BackwardPlan, Region
from ..kernels.space_to_depth import (SpaceToDepthConvKernel, epilogue_program, kernel_reason,
                                      triton_reason)
from .base import Backend, Lowered, Support

__all__ = ["SpaceToDepthStemBackend"]


class SpaceToDepthStemBackend(Backend):
    """Lowers SpaceToDepth stem regions to :class:`SpaceToDepthConvKernel` (module docstring)."""

    name = "triton_stem"

    @classmethod
    def for_options(cls, options: CompileOptions) -> "SpaceToDepthStemBackend":
        return cls()

    def supports(self, region: Region) -> Support:
        if not region.space_to_depth:
            return Support(False)  # not a stem region: not this backend's kind
        reason = triton_reason() or kernel_reason(region.conv_input_placeholder.meta["val"],
                                                  region.conv.args[1].meta["val"],
                                                  region.space_to_depth)
        return Support(not reason, reason)

    def lower(self, region: Region, training: bool = False,
              backward: BackwardPlan | None = None) -> Lowered:
        """The region's :class:`SpaceToDepthConvKernel`.

        Raises:
            UnsupportedError: in training (the kernel has no backward), or the epilogue is not
                one the kernel runs.
        """
        if training:
            raise UnsupportedError("the SpaceToDepth stem kernel runs inference only",
                                   region.region_id)
        image = region.conv_input_placeholder
        program = epilogue_program(region, node_device(image))
        if isinstance(program, str):
            raise UnsupportedError(program, region.region_id)
        operands, ops, outputs = program
        names = [n.name for n in region.graph_module.graph.find_nodes(op="placeholder")]
        kernel = SpaceToDepthConvKernel(names.index(image.name),
                                        names.index(region.conv.args[1].name), operands, ops,
                                        outputs, region.space_to_depth)
        return Lowered(kernel, plan=f"space_to_depth{region.space_to_depth} + conv1x1 + "
                                    f"{len(ops)} epilogue ops, one Triton kernel",
                       workspace_bytes=0)
