"""The reference backend: runs a region with the PyTorch ops of its fx graph.

It takes every region, on any device and dtype; it is the numerics oracle of the tests, the CPU
path, and the fallback when another backend declines a region.
"""

from __future__ import annotations

from ..autograd.backward import RegionBackward, TorchConvGradients
from ..config import CompileOptions
from ..ir.region import BackwardPlan, Region
from ..runtime.region_op import register_backward, register_kernel, run_region
from .base import Backend, Lowered, Support

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """Backend whose kernel is the region's own ``torch.fx.GraphModule`` (PyTorch autograd
    differentiates it).

    Args:
        derived_backward: in training, run regions through the ``run_region`` custom op with the
            derived backward (:class:`~fusion_compiler.autograd.backward.RegionBackward`, PyTorch
            conv gradients) instead of PyTorch autograd: the path cuDNN regions take, checkable
            without a GPU. For tests.
    """

    name = "reference"

    def __init__(self, derived_backward: bool = False):
        self.derived_backward = derived_backward

    @classmethod
    def for_options(cls, options: CompileOptions) -> "ReferenceBackend":
        return cls(derived_backward=options.derived_backward)

    def supports(self, region: Region) -> Support:
        return Support(True)

    def lower(self, region: Region, training: bool = False,
              backward: BackwardPlan | None = None) -> Lowered:
        if not (training and self.derived_backward):
            return Lowered(region.graph_module)
        return Lowered(_RegionOps(region).call)


class _RegionOps:
    """A region's own graph module registered as a ``run_region`` kernel with the derived
    backward; ``key`` is its ``run_region`` key (what a trace of :meth:`call` records)."""

    def __init__(self, region: Region):
        self.key = register_kernel(region.graph_module, region.output_specs(),
                                   f"region {region.region_id}")
        register_backward(self.key, RegionBackward(region, TorchConvGradients(region.conv)))

    def call(self, *inputs):
        return tuple(run_region(self.key, list(inputs)))
