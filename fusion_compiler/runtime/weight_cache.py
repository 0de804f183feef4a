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

    Keyed by the tensor object itself (held weakly) and its version counter (``Tensor._version``
    grows on every in-place update, optimizer steps included), so an updated parameter is copied
    again, and a weight computed afresh each call (a rewritten weight in training, an inference
    tensor) is always converted: a new tensor may reuse a freed one's memory and version number,
    so storage address and version alone would return a stale copy.

    In a CUDA graph capture whose replays follow optimizer updates (a graphed training step) the
    copy is made inside the graph, so every replay converts the weight as the optimizer left it:
    once per step for ``compile()``'s own training graphs (forward and backward share it), at every
    use in a capture of someone else's (see
    :func:`~fusion_compiler.runtime.cuda_graph.weight_cache_scope`).

    Args:
        convert: makes the copy from the weight (default: ``contiguous(channels_last)``, and a
            weight already channels_last is used as it is); e.g. a zero-padding of its channels.
    """

    def __init__(self, convert: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.convert = convert
        self.source: weakref.ref | None = None
        self.version = -1
        self.scope: int | None = None  # weight_cache_scope() when the value was made
        self.value: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        convert = self.convert
        if convert is None:
            if t.is_contiguous(memory_format=torch.channels_last):
                return t
            convert = _channels_last
        if t.is_inference():  # made under inference_mode: no version counter, a fresh tensor
            return convert(t)
        if self.source is not None and self.source() is t and self.version == t._version:
            scope = weight_cache_scope()
            if scope is None or (scope == self.scope and scope != EVERY_CALL):
                return self.value
        self.value = convert(t)
        self.source, self.version, self.scope = weakref.ref(t), t._version, weight_cache_scope()
        return self.value


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)
