"""Kernels of this package's own, each a ``torch.library`` custom op with a Triton
implementation on CUDA and a PyTorch one elsewhere."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["triton_unavailable"]


def triton_unavailable(load: Callable[[], Any]) -> str:
    """Why a Triton kernel cannot run here (``""``: it can): CUDA must be available and
    ``load()``, which imports the kernel's module, must not return ``None``."""
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if load() is None:
        return "Triton does not import"
    return ""
