"""The ``fusion_compiler::run_region`` custom op: how a lowered region is called from a graph.

Going through ``torch.library`` gives every region a fake (meta) implementation, so
``torch.compile``, ``torch.export`` and ``FakeTensor`` propagation see output shapes, strides and
dtypes without running cuDNN. Kernels are registered under an integer key; the registry holds them
weakly, so a region's kernel lives exactly as long as the compiled module that owns it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Sequence

import torch

__all__ = ["run_region", "register_kernel"]

_KERNELS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_OUTPUTS: dict[int, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]] = {}
_KEYS = itertools.count()


def register_kernel(kernel: object,
                    outputs: Sequence[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]) -> int:
    """Register ``kernel`` (callable: tensors -> tuple of tensors) and the ``(shape, stride, dtype)``
    of each output it returns; returns the key to pass to :func:`run_region`."""
    key = next(_KEYS)
    _KERNELS[key] = kernel
    _OUTPUTS[key] = list(outputs)
    weakref.finalize(kernel, _OUTPUTS.pop, key, None)
    return key


@torch.library.custom_op("fusion_compiler::run_region", mutates_args=())
def run_region(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the kernel registered under ``key`` on ``inputs``; returns fresh output tensors."""
    kernel: Callable = _KERNELS[key]
    return list(kernel(*inputs))


@run_region.register_fake
def _run_region_fake(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    device = inputs[0].device
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype in _OUTPUTS[key]]
