"""A channels_last copy of a convolution weight, made once per weight version: what kernels that
read weights as ``[K, R, S, C]`` rows (cuDNN's execution plans, the Triton convolution) hand them
instead of converting the weight at every call."""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .cuda_graph import EVERY_CALL, weight_cache_scope

__all__ = ["WeightCache"]


class WeightCache:
    """channels_last copy of a weight, made once per weight version instead of once per call.

    Keyed by the tensor object itself (held weakly; a view by its base and its place in it) and
    its version counter (``Tensor._version`` grows on every in-place update, optimizer steps
    included), so an updated parameter is copied again, and a weight computed afresh each call (a
    rewritten weight in training, an inference tensor) is always converted: a new tensor may
    reuse a freed one's memory and version number, so storage address and version alone would
    return a stale copy.

    In a CUDA graph capture whose replays follow optimizer updates (a graphed training step) the
    copy is made inside the graph, so every replay converts the weight as the optimizer left it:
    once per step for ``compile()``'s own training graphs (forward and backward share it), at every
    use in a capture of someone else's (see
    :func:`~fusion_compiler.runtime.cuda_graph.weight_cache_scope`).

    Args:
        convert: makes the copy from the weight (default: ``contiguous(channels_last)``, and a
            weight already channels_last is used as it is); e.g. a zero-padding of its channels.
            A cache called with more tensors (``cache(weight, *more)``: a value made from
            several parameters, such as a weight with a folded scale) passes them all to
            ``convert`` and keeps the value while none of them changes.
    """

    def __init__(self, convert: Callable[..., object] | None = None):
        self.convert = convert
        self.sources: tuple[weakref.ref, ...] = ()
        self.versions: tuple = ()  # per tensor: version, storage offset, shape, strides
        self.scope: int | None = None  # weight_cache_scope() when the value was made
        self.value: object = None

    def __call__(self, t: torch.Tensor, *more: torch.Tensor):
        convert = self.convert
        if convert is None:
            if t.is_contiguous(memory_format=torch.channels_last):
                return t
            convert = _channels_last
        tensors = (t, *more)
        if any(x.is_inference() for x in tensors):  # made under inference_mode: no version
            return convert(*tensors)  # counter, a fresh tensor
        versions = tuple((x._version, x.storage_offset(), x.shape, x.stride()) for x in tensors)
        if (self.versions == versions and len(self.sources) == len(tensors)
                and all(ref() is _source(x) for ref, x in zip(self.sources, tensors))):
            scope = weight_cache_scope()
            if scope is None or (scope == self.scope and scope != EVERY_CALL):
                return self.value
        self.value = convert(*tensors)
        self.sources = tuple(weakref.ref(_source(x)) for x in tensors)
        self.versions, self.scope = versions, weight_cache_scope()
        return self.value


def _source(t: torch.Tensor) -> torch.Tensor:
    """The tensor a cached value is keyed by: ``t``'s base when ``t`` is a view (a graph reshapes
    a conv bias to ``[1, K, 1, 1]`` afresh at every call; a view shares its base's version
    counter, so an in-place update of the base still shows), else ``t``."""
    return t._base if t._base is not None else t


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)
