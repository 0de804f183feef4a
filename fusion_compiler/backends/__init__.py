"""Backends that lower regions to kernels: ``reference`` (torch ops) and ``cudnn`` (execution plans)."""

from __future__ import annotations

from .base import Backend, Kernel, Support
from .reference import ReferenceBackend

__all__ = ["Backend", "Kernel", "Support", "ReferenceBackend", "get_backend"]


def get_backend(name: str, **options) -> Backend:
    """The backend called ``name`` (``"reference"`` or ``"cudnn"``) made with ``options``.

    Raises:
        ValueError: unknown name.
    """
    if name == "reference":
        return ReferenceBackend(**options)
    if name == "cudnn":
        from .cudnn.backend import CudnnBackend  # noqa: PLC0415  (keeps `import cudnn` lazy)

        return CudnnBackend.shared(**options)
    raise ValueError(f"unknown backend {name!r}; choose 'reference' or 'cudnn'")
