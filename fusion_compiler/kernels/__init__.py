"""Kernels of this package's own, each a ``torch.library`` custom op with a Triton
implementation on CUDA and a PyTorch one elsewhere."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["triton_unavailable", "prewarm_triton"]

_prewarm_started = False


def triton_unavailable(load: Callable[[], Any]) -> str:
    """Why a Triton kernel cannot run here (``""``: it can): CUDA must be available and
    ``load()``, which imports the kernel's module, must not return ``None``."""
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if load() is None:
        return "Triton does not import"
    return ""


def prewarm_triton() -> None:
    """Start computing, on the package's background thread
    (:func:`~fusion_compiler.runtime.background.submit`), what the first Triton kernel launch of a
    process computes before it looks anything up: the key of Triton's on-disk kernel cache, a hash
    of Triton's own sources and library, cached for the process (``triton.runtime.cache.
    triton_key``). Most of it is hashing and file reads, which release the GIL, so it runs beside
    the calling thread's work; done on the first launch instead, it took 0.43 s of a warm start's
    0.60 s CUDA-graph capture (docs/decisions.md, "Triton's cache key computed in the
    background"). Once per process; a no-op where Triton does not import or has no such
    function."""
    global _prewarm_started
    if _prewarm_started:
        return
    _prewarm_started = True
    from ..runtime.background import submit  # noqa: PLC0415

    submit(_triton_cache_key)


def _triton_cache_key() -> None:
    try:
        from triton.runtime import cache  # noqa: PLC0415
        key = getattr(cache, "triton_key", None)
        if key is not None:
            key()
    except Exception:  # noqa: BLE001 - a warm-up only: the first launch computes it anyway
        pass
