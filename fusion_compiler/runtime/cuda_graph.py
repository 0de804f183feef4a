"""Replay a whole compiled forward as one CUDA graph (``torch.cuda.CUDAGraph``).

The forward is warmed up on a side stream (so every cuDNN plan is built and the workspace sized
before capture: ``execute()`` must not build inside a capture, CUDNN_FACTS.md), then captured once.
Each call copies the inputs into static buffers, replays, and returns the **static** output
tensors: they are overwritten by the next call. Clone an output you want to keep.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["CudaGraphRunner"]


class CudaGraphRunner:
    """Capture ``fn(*example_args)`` in a CUDA graph; call with inputs of the same shapes/dtypes.

    Args:
        fn: the forward to capture; it must only launch work on the current stream.
        example_args: real CUDA tensors (their values are used for the warm-up runs).
        warmup: eager runs before capture.
        guard: called before each replay; when its value changes (e.g. the parameters' version
            counters after an optimizer step or ``load_state_dict``) the forward is captured
            again, so work that the forward caches per parameter version stays right.
    """

    def __init__(self, fn: Callable[..., Any], example_args: Sequence[Any], warmup: int = 2,
                 guard: Callable[[], Any] | None = None):
        self.fn, self.warmup, self.guard = fn, warmup, guard
        self.static_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_args]
        self._capture()

    def _capture(self) -> None:
        fn = self.fn
        self.token = self.guard() if self.guard is not None else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(*self.static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = fn(*self.static_inputs)

    def __call__(self, *args: Any) -> Any:
        if self.guard is not None and self.guard() != self.token:
            self._capture()
        for static, a in zip(self.static_inputs, args):
            if isinstance(static, torch.Tensor):
                static.copy_(a)
        self.graph.replay()
        return self.static_outputs

    def output_tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten(self.static_outputs)[0] if isinstance(t, torch.Tensor)]
