"""Tensor utilities the runners share: buffers given back their values after work that must not
move them, gradients laid out like their parameters."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

__all__ = ["restored", "layout_like"]


@contextlib.contextmanager
def restored(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Give ``tensors`` back their values on exit (one copy each, taken on entry; tensors made
    under ``inference_mode`` cannot be written and are left out): for work that runs a model
    without meaning to, which must not move batch norm's running statistics."""
    tensors = [t for t in tensors if not t.is_inference()]
    with torch.no_grad():
        saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(tensors, saved):
                t.copy_(s)


def layout_like(g: torch.Tensor, ref: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``g`` (same shape as ``ref``) with ``ref``'s strides where that is free: a view when the
    two differ only in the strides of size-1 dimensions (a 1x1 weight's gradient written
    channels_last, which DistributedDataParallel's buckets would otherwise flag and copy; size-1
    dimensions are never stepped along, so the view addresses the same elements). Other
    differences give a copy with ``copy``, else ``g`` as it is."""
    if g.stride() == ref.stride() or g.shape != ref.shape:
        return g
    if all(a == b or n == 1 for a, b, n in zip(g.stride(), ref.stride(), g.shape)):
        return g.as_strided(ref.shape, ref.stride())
    return torch.empty_like(ref, dtype=g.dtype).copy_(g) if copy else g
