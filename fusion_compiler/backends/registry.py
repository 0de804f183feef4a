"""The backend registry: which backends exist, and the ones a compile asks.

Each registration is a name and a factory that makes the backend from the
:class:`~fusion_compiler.config.CompileOptions` of a compile. A compile asks the backends its
``backends`` option names, in that order, whether they take a region; the ``reference`` backend
(PyTorch ops) takes every region and is always the fallback. Where more than one named backend
takes a region, lowering times their kernels and keeps the fastest
(:func:`fusion_compiler.lowering.lower`). Adding a backend is one module plus one
:func:`register_backend` call (``backends/__init__.py`` registers the built-in ones); a compile
uses it once its name is in ``backends``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..config import CompileOptions
from .base import Backend

__all__ = ["Registration", "register_backend", "registered", "backends_for", "check_backends",
           "REFERENCE"]

REFERENCE = "reference"
"""The name of the fallback backend, which takes every region."""


@dataclass(frozen=True)
class Registration:
    """One registered backend: ``make(options)`` returns it (it may import its dependencies
    then, and share one instance between compiles)."""

    name: str
    make: Callable[[CompileOptions], Backend]


_REGISTRY: dict[str, Registration] = {}


def register_backend(name: str, make: Callable[[CompileOptions], Backend]) -> None:
    """Register the backend ``name`` (a compile asks it where its ``backends`` option names it).

    Raises:
        ValueError: ``name`` is registered already.
    """
    if name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is registered already")
    _REGISTRY[name] = Registration(name, make)


def registered() -> list[Registration]:
    """Every registration, in the order of registration."""
    return list(_REGISTRY.values())


def check_backends(names: Sequence[str]) -> None:
    """Raises:
        ValueError: a name in ``names`` (a ``backends`` option) that no backend is registered
            under (the message lists those that are)."""
    unknown = [n for n in names if n not in _REGISTRY or n == REFERENCE]
    if unknown:
        known = ", ".join(repr(n) for n in _REGISTRY if n != REFERENCE)
        raise ValueError(f"backends: no backend named {unknown[0]!r} (registered: {known})")


def backends_for(options: CompileOptions) -> list[Backend]:
    """The backends a compile with ``options`` asks: those ``options.backends`` names, in its
    order, then the reference.

    Raises:
        ValueError: see :func:`check_backends`.
    """
    check_backends(options.backends)
    return [_REGISTRY[n].make(options) for n in (*options.backends, REFERENCE)]
