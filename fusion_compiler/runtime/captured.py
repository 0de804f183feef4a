"""One captured CUDA graph of a compiled forward and how a replay hands out its outputs
(:class:`CapturedForward`, the graphs of :class:`~.cuda_graph.CudaGraphRunner`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_unflatten

from .replays import GraphTurn
from .tensors import StreamOrder, output_leaves

__all__ = ["CapturedForward", "input_aliases"]


def input_aliases(leaves: Sequence[Any], inputs: Sequence[Any]) -> dict[int, tuple]:
    """The output leaves (:func:`output_leaves`) that share memory with a tensor in ``inputs``
    (the first such input):
    ``{leaf position: (input position, the input's strides, view)}``, ``view`` ``None`` where the
    leaf is the input itself (the same tensor object), else ``(sizes, strides, offset)``
    of the leaf with its offset in elements counted from the input's; a leaf of another dtype
    than its input gets ``None`` for the input's strides (no view of the caller's tensor makes
    it). A CUDA graph's replay returns the caller's tensors there (eager returns them)."""
    where: dict[int, int] = {}  # storage -> the first input on it
    for i, a in enumerate(inputs):
        if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr():  # (empty: 0)
            where.setdefault(a.untyped_storage().data_ptr(), i)
    found: dict[int, tuple] = {}
    for k, t in enumerate(leaves):
        i = where.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None
        if i is None:
            continue
        a = inputs[i]
        # the input itself (``return x``), or a new tensor on its memory (``x.detach()``, a view
        # of the same sizes): eager returns a new tensor object there
        view = None if t is a else (tuple(t.shape), t.stride(),
                                    t.storage_offset() - a.storage_offset())
        found[k] = (i, a.stride() if t.dtype == a.dtype else None, view)
    return found


class CapturedForward:
    """One captured CUDA graph of the forward and its output buffers, with what handing those
    buffers out needs: their storages (``_cdata`` pointers) and the reference counts they have
    while only the runner holds them (``None`` when they are never handed out: this torch
    cannot count references), and the outputs that are inputs of the capture or views of one
    (:func:`input_aliases`: the caller's tensors are returned there), or tensors of ``state``
    (the model's parameters and buffers, which the graph reads and writes where they are) or
    views of one: those tensors are returned there, as eager returns ``self.calls``.

    A replay on another stream than the previous replay's first waits for the work queued on
    that stream (:class:`~.tensors.StreamOrder`): work the caller queued there may still read
    buffers that replay handed out, though the caller has let go of them since (the runner's
    turns order its calls, not the caller's work after one; a graph's previous replay may be
    several calls back, the calls between served by another graph)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Any, inputs: Sequence[Any],
                 stream: torch.cuda.Stream, state: Sequence[torch.Tensor] = ()):
        self.graph, self.outputs = graph, outputs
        self.state = list(state)
        self.turn = GraphTurn(stream)
        self.order = StreamOrder(torch.device("cuda", torch.cuda.current_device()))
        self.storages: list[int] | None = None
        self._leaves, self._spec = output_leaves(outputs)
        self.aliases = input_aliases(self._leaves, [*inputs, *self.state])
        flat = [t for k, t in enumerate(self._leaves)
                if isinstance(t, torch.Tensor) and k not in self.aliases]
        if hasattr(torch._C, "_storage_Use_Count"):
            self.storages = [t.untyped_storage()._cdata for t in flat]
        self.sole_use = self._use_counts()

    def _use_counts(self) -> tuple[int, ...] | None:
        if self.storages is None:
            return None
        return tuple(torch._C._storage_Use_Count(cdata) for cdata in self.storages)

    def held(self) -> bool:
        """Whether something besides the runner holds a buffer handed out (or a view of one)."""
        return self.storages is not None and self._use_counts() != self.sole_use

    def fits(self, args: Sequence[Any]) -> bool:
        """Whether the outputs that are views of an input can be made on ``args`` (the caller's
        tensors have the strides of the capture's inputs wherever such a view is not the whole
        input)."""
        if not self.aliases:
            return True
        sources = [*args, *self.state]
        return all(view is None or sources[i].stride() == stride
                   for i, stride, view in self.aliases.values())

    def replay(self, outputs: str, args: Sequence[Any]) -> Any:
        """Replay and return the outputs: ``"copies"`` copies of the output buffers, ``"safe"``
        the buffers as new tensor objects (each one held adds to its storage's count) when they
        may be handed out, else copies. An output that is an input of the capture, or a view of
        one, is the caller's tensor in ``args`` (or the same view of it), as in eager: a write
        into it reaches the caller's tensor (requires :meth:`fits`)."""
        self.order.follow()
        with self.turn.replaying():
            self.graph.replay()
        copy = outputs == "copies" or self.storages is None
        out = self.outputs
        if isinstance(out, torch.Tensor) and not self.aliases:  # (most models: one tensor)
            return out.clone() if copy else out.detach()
        leaves = [(t.clone() if copy else t.detach()) if isinstance(t, torch.Tensor) else t
                  for t in self._leaves]
        sources = [*args, *self.state]
        for k, (i, _, view) in self.aliases.items():
            leaves[k] = sources[i] if view is None else sources[i].as_strided(
                view[0], view[1], sources[i].storage_offset() + view[2])
        return tree_unflatten(leaves, self._spec)

    def reset(self) -> None:
        self.graph.reset()
        self.outputs = self._leaves = None
