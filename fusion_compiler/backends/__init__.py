"""Backends that lower regions to kernels, and their registry.

Registered here, highest priority first: ``triton`` (kernels of this package's own: the
SpaceToDepth stem, and under ``triton_conv`` an implicit-GEMM convolution; :mod:`.triton`),
``dense`` (a convolution of a small image as one dense GEMM, :mod:`.dense`),
``cudnn`` (cuDNN execution plans, :mod:`.cudnn`) and ``reference`` (the region's PyTorch ops,
:mod:`.reference`: takes every region, the fallback). A new backend is one
module plus one :func:`~.registry.register_backend` line below.
"""

from __future__ import annotations

from ..config import CompileOptions
from .base import PLAN_WORK, REUSE_BATCH_RATIO, Backend, Kernel, Lowered, Support
from .reference import ReferenceBackend
from .registry import REFERENCE, backends_for, register_backend, registered

__all__ = ["Backend", "Kernel", "Lowered", "Support", "PLAN_WORK", "REUSE_BATCH_RATIO",
           "ReferenceBackend",
           "register_backend", "registered", "backends_for", "REFERENCE"]


def _cudnn(options: CompileOptions) -> Backend:
    from .cudnn.backend import CudnnBackend  # noqa: PLC0415  (keeps `import cudnn` lazy)

    return CudnnBackend.for_options(options)


def _dense(options: CompileOptions) -> Backend:
    from .dense import DenseConvBackend  # noqa: PLC0415

    return DenseConvBackend.for_options(options)


def _triton(options: CompileOptions) -> Backend:
    from .triton import TritonBackend  # noqa: PLC0415

    return TritonBackend.for_options(options)


register_backend(REFERENCE, ReferenceBackend.for_options, priority=0)
register_backend("cudnn", _cudnn, priority=10)
register_backend("dense", _dense, priority=15)
register_backend("triton", _triton, priority=20)
