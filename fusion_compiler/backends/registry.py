"""The backend registry: which backends exist, in which order lowering asks them.

Each registration is a name, a priority and a factory that makes the backend from the
:class:`~fusion_compiler.config.CompileOptions` of a compile. For a region, lowering asks the
backends in decreasing priority whether they take it; the ``reference`` backend (priority 0,
PyTorch ops) takes every region and is the fallback. Where more than one backend besides the
reference takes a region, lowering times their kernels and keeps the fastest
(:func:`fusion_compiler.lowering.lower`). Adding a backend is one module plus one
:func:`register_backend` call (``backends/__init__.py`` registers the built-in ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import CompileOptions
from .base import Backend

__all__ = ["Registration", "register_backend", "registered", "backends_for", "REFERENCE"]

REFERENCE = "reference"
"""The name of the fallback backend, which takes every region."""


@dataclass(frozen=True)
class Registration:
    """One registered backend: ``make(options)`` returns it (it may import its dependencies
    then, and share one instance between compiles)."""

    name: str
    priority: int
    make: Callable[[CompileOptions], Backend]


_REGISTRY: dict[str, Registration] = {}


def register_backend(name: str, make: Callable[[CompileOptions], Backend], *,
                     priority: int) -> None:
    """Register the backend ``name``; lowering asks backends of higher ``priority`` first.

    Raises:
        ValueError: ``name`` is registered already, or a backend other than the reference has a
            priority of 0 or less (the reference's place).
    """
    if name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is registered already")
    if name != REFERENCE and priority <= 0:
        raise ValueError(f"backend {name!r}: priorities of 0 and less are the reference's")
    _REGISTRY[name] = Registration(name, priority, make)


def registered() -> list[Registration]:
    """Every registration, highest priority first."""
    return sorted(_REGISTRY.values(), key=lambda r: -r.priority)


def backends_for(options: CompileOptions) -> list[Backend]:
    """The backends a compile with ``options`` asks, highest priority first, the reference last
    (``backend="reference"``: the reference alone)."""
    chosen = [r for r in registered()
              if options.backend != REFERENCE or r.name == REFERENCE]
    return [r.make(options) for r in chosen]
