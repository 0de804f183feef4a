"""The reference backend: runs a region with the PyTorch ops of its fx graph.

It takes every region, on any device and dtype; it is the numerics oracle of the tests, the CPU
path, and the fallback when another backend declines a region.
"""

from __future__ import annotations

from ..region import Region
from .base import Kernel, Support

__all__ = ["ReferenceBackend"]


class ReferenceBackend:
    """Backend whose kernel is the region's own ``torch.fx.GraphModule``."""

    name = "reference"

    def supports(self, region: Region) -> Support:
        return Support(True)

    def lower(self, region: Region) -> Kernel:
        return region.graph_module
