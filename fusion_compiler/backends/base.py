"""The backend protocol: a backend says whether it takes a region and lowers it to a kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from ..ir.region import Region

__all__ = ["Support", "Backend", "Kernel"]

Kernel = Callable[..., Any]
"""A lowered region: called with the region inputs, returns the tuple of region outputs."""


@dataclass(frozen=True)
class Support:
    """Answer of :meth:`Backend.supports`: ``ok``, and when not ok, the backend's ``reason``."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@runtime_checkable
class Backend(Protocol):
    """What every backend implements.

    ``supports`` must be cheap and must not raise; ``lower`` may raise
    :class:`~fusion_compiler.errors.UnsupportedError` with the backend's reason when a region it
    claimed to support is rejected while building (the caller then falls back). With ``training``
    the kernel must be differentiable (PyTorch autograd sees through it, or it runs the
    ``run_region`` op with a registered backward).
    """

    name: str

    def supports(self, region: Region) -> Support: ...

    def lower(self, region: Region, training: bool = False) -> Kernel: ...
