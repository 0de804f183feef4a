"""Kernels of this package's own, each a ``torch.library`` custom op with a Triton
implementation on CUDA and a PyTorch one elsewhere."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..ir.errors import condense
from ..runtime.triton_import import triton_import_error

__all__ = ["triton_unavailable", "triton_import_error", "load_kernel", "prewarm_triton",
           "next_power_of_two"]

_prewarm_started = False


def next_power_of_two(v: int) -> int:
    """The smallest power of two at least ``v`` (1 for ``v <= 1``): a tile size covering ``v``."""
    return 1 << max(0, int(v) - 1).bit_length()


def load_kernel(what: str, load: Callable[[], Any]) -> Any:
    """``load()`` (it imports Triton and returns a kernel or kernel module), or ``None`` when
    Triton does not import or ``load()`` raises. Where CUDA is available that is one WARNING
    per kernel naming it and the error (the calls then run the kernel's PyTorch reference):
    a fallback is never silent. Callers cache the result."""
    reason = triton_import_error()
    if not reason:
        try:
            return load()
        except Exception as exc:  # a kernel that does not compile, a broken install
            reason = condense(f"{type(exc).__name__}: {exc}", limit=200)
    if torch.cuda.is_available():
        from ..runtime.background import warn_once  # noqa: PLC0415

        warn_once(f"loading the Triton kernel {what}", f"{reason}; its calls run PyTorch ops")
    return None


def triton_unavailable(load: Callable[[], Any]) -> str:
    """Why a Triton kernel cannot run here (``""``: it can): CUDA must be available and
    ``load()``, which loads the kernel (:func:`load_kernel`), must not return ``None``."""
    if not torch.cuda.is_available():
        return "CUDA is not available on this machine"
    if load() is None:
        error = triton_import_error()
        return f"Triton does not import ({error})" if error else "the Triton kernel did not load"
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
    function. Triton itself is imported here first, on the calling thread (0.27 s on an H200
    host where nothing imported it before; docs/architecture.md: two threads importing it at
    once can each see it half imported)."""
    global _prewarm_started
    if _prewarm_started:
        return
    _prewarm_started = True
    if triton_import_error():  # Triton is imported here, on the calling thread, not beside it
        return
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
