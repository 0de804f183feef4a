"""Backends that lower regions to kernels, and their registry.

Registered here: ``triton_stem`` (the SpaceToDepth stem kernel of this package's own,
:mod:`.triton_stem`), ``triton_conv`` (an implicit-GEMM convolution of this package's own,
:mod:`.triton`), ``triton_depthwise`` (a depthwise convolution of this package's own,
:mod:`.triton_depthwise`), ``hopper_conv`` (a TMA + wgmma convolution of this package's own
for Hopper GPUs, :mod:`.hopper_conv`), ``dense`` (a convolution of a small image as one dense GEMM,
:mod:`.dense`), ``cudnn`` (cuDNN execution plans, :mod:`.cudnn`) and ``reference`` (the
region's PyTorch ops, :mod:`.reference`: takes every region, the fallback). A compile asks
those its ``backends`` option names (:data:`~fusion_compiler.config.DEFAULT_BACKENDS` by
default), in that order. A new backend is one module plus one
:func:`~.registry.register_backend` line below.
"""

from __future__ import annotations

from ..config import CompileOptions
from .base import PLAN_WORK, REUSE_BATCH_RATIO, Backend, Kernel, Lowered, Support
from .reference import ReferenceBackend
from .registry import REFERENCE, backends_for, check_backends, register_backend, registered

__all__ = ["Backend", "Kernel", "Lowered", "Support", "PLAN_WORK", "REUSE_BATCH_RATIO",
           "ReferenceBackend",
           "register_backend", "registered", "backends_for", "check_backends", "REFERENCE"]


def _cudnn(options: CompileOptions) -> Backend:
    from .cudnn.backend import CudnnBackend  # noqa: PLC0415  (keeps `import cudnn` lazy)

    return CudnnBackend.for_options(options)


def _dense(options: CompileOptions) -> Backend:
    from .dense import DenseConvBackend  # noqa: PLC0415

    return DenseConvBackend.for_options(options)


def _triton_conv(options: CompileOptions) -> Backend:
    from .triton import TritonConvBackend  # noqa: PLC0415

    return TritonConvBackend.for_options(options)


def _triton_depthwise(options: CompileOptions) -> Backend:
    from .triton_depthwise import TritonDepthwiseBackend  # noqa: PLC0415

    return TritonDepthwiseBackend.for_options(options)


def _hopper_conv(options: CompileOptions) -> Backend:
    from .hopper_conv import HopperConvBackend  # noqa: PLC0415

    return HopperConvBackend.for_options(options)


def _triton_stem(options: CompileOptions) -> Backend:
    from .triton_stem import SpaceToDepthStemBackend  # noqa: PLC0415

    return SpaceToDepthStemBackend.for_options(options)


register_backend(REFERENCE, ReferenceBackend.for_options)
register_backend("triton_stem", _triton_stem)
register_backend("triton_conv", _triton_conv)
register_backend("triton_depthwise", _triton_depthwise)
register_backend("hopper_conv", _hopper_conv)
register_backend("dense", _dense)
register_backend("cudnn", _cudnn)
