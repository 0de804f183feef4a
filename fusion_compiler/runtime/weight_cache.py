"""Values kernels derive from weights (a channels_last copy, a zero-padded or packed copy, a dense
matrix with a folded scale) and how long one may be reused.

A :class:`WeightCache` belongs to a kernel and makes its value from the tensors it is handed.
Outside a scope it makes the value at every call: nothing is remembered, so a value can never be
older than its weight. Within a scope (on this thread):

- :func:`derivation_epoch`: the value is made once per epoch and reused by every call in it: one
  CUDA-graph capture whose replays recompute it in the graph (a training step: forward and
  backward share the copy), or a timing graph.
- a derivation scope (:class:`~fusion_compiler.runtime.derivations.Derivations`, an inference CUDA
  graph): the scope hands out a persistent tensor that its graph rewrites whenever the weights it
  is made from change (a content fingerprint, :mod:`fusion_compiler.runtime.derive`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from ..ir import region

__all__ = ["WeightCache", "Epoch", "derivation_epoch", "derivation_scope", "current_scope",
           "note_reads", "cache_key"]

_local = threading.local()


def current_scope() -> Any:
    """The innermost scope open on this thread, or ``None``."""
    return getattr(_local, "scope", None)


@contextlib.contextmanager
def _scoped(scope: Any) -> Iterator[Any]:
    outer = current_scope()
    _local.scope = scope
    try:
        yield scope
    finally:
        _local.scope = outer


class Epoch:
    """Values made once within one :func:`derivation_epoch`; it holds them (a CUDA graph that
    captured them keeps the epoch, so their memory outlives the capture)."""

    def __init__(self) -> None:
        self.values: dict[int, tuple[tuple, Any]] = {}

    def lookup(self, cache: "WeightCache", tensors: tuple[torch.Tensor, ...]) -> Any:
        key = cache_key(tensors)
        known = self.values.get(id(cache))
        if known is not None and known[0] == key:
            return known[1]
        value = cache.convert(*tensors)
        self.values[id(cache)] = (key, value)
        return value


def derivation_epoch() -> contextlib.AbstractContextManager[Epoch]:
    """Within it, each :class:`WeightCache` makes its value once (per tensors it is handed) and
    reuses it: for a CUDA-graph capture whose replays must recompute the values in the graph
    (every use after the first reads the first's), or a timing graph (made before the capture by
    a warm-up call in the same epoch). Returns the epoch, which holds the values: keep it as
    long as a graph that reads them."""
    return _scoped(Epoch())


def derivation_scope(scope: Any) -> contextlib.AbstractContextManager[Any]:
    """Within it, :class:`WeightCache` calls go to ``scope.lookup(cache, tensors)`` (an
    inference CUDA graph's :class:`~fusion_compiler.runtime.derivations.Derivations`)."""
    return _scoped(scope)


def note_reads(tensors: Any) -> None:
    """A kernel is about to read ``tensors``: the scope (a derivation scope) may need to order
    work before it (:meth:`~fusion_compiler.runtime.derivations.Derivations.reads`). Installed
    as :mod:`fusion_compiler.ir.region`'s read hook, so every region's inputs are noted."""
    scope = current_scope()
    reads = getattr(scope, "reads", None)
    if reads is not None:
        reads(tensors)


region.set_read_hook(note_reads)


def cache_key(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """What a cached value was made from: each tensor's memory, layout and dtype."""
    return tuple((x.data_ptr(), tuple(x.shape), x.stride(), x.dtype) for x in tensors)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


class WeightCache:
    """A kernel's value derived from the tensors it is handed (see the module docstring).

    Args:
        convert: makes the value (default: ``contiguous(channels_last)``; a weight that already
            is channels_last is used as it is). Called as ``convert(weight, *more)``; it may
            return a tensor or a tuple of tensors.
        describe: ``describe(*exprs)`` gives the value as
            :class:`~fusion_compiler.runtime.derive.Expr` s of the inputs' (what lets a
            derivation scope recompute it on the GPU); ``None`` with ``rearrangement``: ``convert``
            itself applied to index arrays; ``None`` otherwise: the scope computes it with
            ``convert`` at every replay.
        rearrangement: ``convert`` only moves, copies or zero-fills elements of its one input (no
            arithmetic, no dtype change).
    """

    def __init__(self, convert: Callable[..., Any] | None = None,
                 describe: Callable[..., Any] | None = None, rearrangement: bool = False):
        self.default = convert is None
        self.convert = _channels_last if convert is None else convert
        if describe is None and (rearrangement or self.default):
            from .derive import Expr  # noqa: PLC0415

            describe = lambda e: Expr.rearranged(self.convert, e)  # noqa: E731
        self.describe = describe

    def __call__(self, t: torch.Tensor, *more: torch.Tensor) -> Any:
        if self.default and t.is_contiguous(memory_format=torch.channels_last):
            return t
        scope = current_scope()
        if scope is None:
            return self.convert(t, *more)
        return scope.lookup(self, (t, *more))
