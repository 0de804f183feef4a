"""The ``dense`` backend: a convolution of a small image as one dense GEMM (cuBLAS through
``torch.addmm``), with the region's leading affine epilogue and a ReLU folded into the GEMM
(:mod:`fusion_compiler.kernels.dense_conv`).

It takes CUDA inference regions whose image has no more pixels than the filter, larger than
1x1, has taps (``H*W <= R*S``: the GEMM then does at most the convolution's nominal work, and
skips the taps on the padding; :func:`~fusion_compiler.kernels.dense_conv.small_image`). cuDNN
takes the same regions, so lowering times both kernels on the region's shapes and keeps the
faster (:func:`fusion_compiler.lowering.lower`), the choice cached on disk.
Among the default backends: on an H100 it beat cuDNN's plan on SE-ResNet9's 3x3
convolutions of 2x2 images (docs/decisions.md, "Small images as one dense GEMM").
"""

from __future__ import annotations

from ..config import CompileOptions
from ..ir.errors import UnsupportedError
from ..ir.ops import node_device
from ..ir.region import BackwardPlan, Region
from ..kernels.dense_conv import DenseConvKernel, DenseProgram, dense_program, small_image
from .base import Backend, Lowered, Support

__all__ = ["DenseConvBackend"]


class DenseConvBackend(Backend):
    """Small-image convolution regions as one dense GEMM (module docstring). Regions off CUDA,
    or whose image is not small for the filter, are declined without a reason (not this
    backend's kind); others it cannot run with the reason."""

    name = "dense"
    devices = ("cuda",)
    """Device types whose regions it takes (tests add ``"cpu"``: the kernel is torch ops)."""

    @classmethod
    def for_options(cls, options: CompileOptions) -> "DenseConvBackend":
        return cls()

    def supports(self, region: Region) -> Support:
        device = node_device(region.conv)
        if device.type not in self.devices or not small_image(region):
            return Support(False)
        program = dense_program(region, device)
        return Support(not isinstance(program, str),
                       f"dense GEMM: {program}" if isinstance(program, str) else "")

    def lower(self, region: Region, training: bool = False,
              backward: BackwardPlan | None = None) -> Lowered:
        """The region's :class:`~fusion_compiler.kernels.dense_conv.DenseConvKernel`.

        Raises:
            UnsupportedError: in training (the kernel has no backward of its own), or the
                region is not one the kernel takes.
        """
        if training:
            raise UnsupportedError("the dense GEMM runs inference only", region.region_id)
        program = dense_program(region, node_device(region.conv))
        if isinstance(program, str):
            raise UnsupportedError(f"dense GEMM: {program}", region.region_id)
        outputs = [(tuple(o.meta["val"].shape), o.meta["val"].dtype)
                   for o in region.output_nodes]
        kernel = DenseConvKernel(program, outputs, name=f"region {region.region_id}")
        return Lowered(kernel.call, plan=_label(program), plan_from_cache=None,
                       workspace_bytes=0,
                       nhwc_inputs=frozenset({program.conv.image_at, *(
                           at for at, kind in zip(program.conv.operands, program.conv.kinds)
                           if kind == 2)}))


def _label(program: DenseProgram) -> str:
    rows, cols = program.dense_shape
    left = len(program.conv.ops) - program.folded
    rest = f", {left} epilogue ops as PyTorch ops" if left else ""
    return (f"dense GEMM [{rows} x {cols}] (cuBLAS) with {program.folded} folded epilogue "
            f"ops{rest}")
