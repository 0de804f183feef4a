"""Replay a whole compiled forward as one CUDA graph (``torch.cuda.CUDAGraph``).

The forward is warmed up on a side stream (so every cuDNN plan is built, the workspace sized and
Inductor's kernels compiled before capture: ``execute()`` must not build inside a capture,
CUDNN_FACTS.md), then captured once. Each call copies the inputs into static buffers and replays.

Outputs: with ``copy_outputs`` (the default of ``compile()``) a later call never overwrites what
an earlier one returned. A call hands out the graph's output buffers themselves (as new tensor
objects) when nothing holds what the previous call handed out: the buffers' storages are then
referenced by the runner alone (``torch._C._storage_Use_Count``, the check Inductor's CUDA graph
trees make on their outputs). When something still does (the output, or a view of it), the call
replays a second graph, captured at the first such call in the same memory pool, whose outputs
never leave the runner, and returns copies of them (one device copy per output, on the current
stream). On an H100, SE-ResNet9 RGB N=128 ran 0.177 ms per call with a copy on every call and
0.167 ms with none (``cuda_graph="static"``, ``examples/benchmark.py``): the copy is a kernel of
its own after the graph. Handing out the buffers, it ran 0.165 ms against static's 0.168 in one
run (depth C=11 N=512: 0.389 against 0.387). Without ``copy_outputs`` (``cuda_graph="static"``)
calls return the static buffers themselves, which the next call overwrites.

A forward that cannot be captured (a host synchronization such as ``.item()``, a copy from pageable
host memory, data-dependent shapes) raises :class:`CaptureError` at construction; the caller then
runs it without a graph.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import condense
from .tiered import COMPILE_LOCK

__all__ = ["CudaGraphRunner", "CaptureError", "EVERY_CALL", "parameters_guarded",
           "parameters_updated_between_replays", "weight_cache_scope"]


class CaptureError(RuntimeError):
    """The forward could not be captured in a CUDA graph; the message says why (CUDA's error)."""


_EPOCHS = itertools.count(1)
_UNSET = object()
_scope: Any = _UNSET
EVERY_CALL = -1
"""What :func:`weight_cache_scope` returns in a capture nobody marked: cache nothing."""


@contextlib.contextmanager
def _scoped(value: Any) -> Iterator[Any]:
    global _scope
    outer, _scope = _scope, value
    try:
        yield value
    finally:
        _scope = outer


def parameters_updated_between_replays() -> contextlib.AbstractContextManager[int]:
    """Mark a capture whose replays must see in-place parameter updates (a training step: the
    optimizer updates parameters between replays, and nothing captures again).

    Work that a kernel caches per parameter version on the host (a channels_last copy of a weight)
    must then be done inside the graph: while this context is open, :func:`weight_cache_scope`
    returns a number new to this context, and caches make their value once in it (the forward and
    backward captures of one step share it).
    """
    return _scoped(next(_EPOCHS))


def parameters_guarded() -> contextlib.AbstractContextManager[None]:
    """Mark a capture that is redone whenever a parameter changes (:class:`CudaGraphRunner` with
    a ``guard`` on the parameters' versions): host-side caches per parameter version stay valid,
    and their values are read by the graph, not recomputed in it."""
    return _scoped(None)


def weight_cache_scope() -> int | None:
    """How long a value cached per parameter version (``Tensor._version``) may be reused now.

    ``None``: while the version is unchanged (eager calls, and captures under
    :func:`parameters_guarded`). A positive number: within the open
    :func:`parameters_updated_between_replays` context of that number only. :data:`EVERY_CALL`:
    not at all, in any other CUDA graph capture (a training step a user captures by hand, whose
    replays follow optimizer updates that no version check on the host can see).
    """
    if _scope is not _UNSET:
        return _scope
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return EVERY_CALL
    return None


def _release_rng_capture(device: int) -> None:
    """Take the default CUDA generator of ``device`` out of capture mode after a failed capture.

    ``CUDAGraph.capture_end`` runs the generators' capture epilogue only when the capture
    succeeded; after a failed one the generator stays in capture mode and the next random op
    outside a capture raises "Offset increment outside graph capture encountered unexpectedly".
    A fresh copy of its state (same seed and offset, not capturing) replaces the stuck one.
    """
    generator = torch.cuda.default_generators[device]
    generator.graphsafe_set_state(generator.clone_state())


class CudaGraphRunner:
    """Capture ``fn(*example_args)`` in a CUDA graph; call with inputs of the same shapes/dtypes.

    Args:
        fn: the forward to capture; it must only launch work on the current stream.
        example_args: real CUDA tensors (their values are used for the warm-up runs).
        warmup: eager runs before capture.
        guard: called before each replay; when its value changes (e.g. the parameters' version
            counters after an optimizer step or ``load_state_dict``) the forward is captured
            again, so work that the forward caches per parameter version stays right.
        copy_outputs: never return a buffer a later call overwrites (the buffers while nothing
            holds the last ones handed out, else copies: see the module docstring).

    Raises:
        CaptureError: the forward cannot be captured (the graph is discarded).
    """

    def __init__(self, fn: Callable[..., Any], example_args: Sequence[Any], warmup: int = 2,
                 guard: Callable[[], Any] | None = None, copy_outputs: bool = True):
        self.fn, self.warmup, self.guard = fn, warmup, guard
        self.copy_outputs = copy_outputs
        self.static_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_args]
        self.graph: torch.cuda.CUDAGraph | None = None
        self._spare: torch.cuda.CUDAGraph | None | bool = None  # False: cannot be captured
        self._capture()

    def _capture(self) -> None:
        fn = self.fn
        self.token = self.guard() if self.guard is not None else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with COMPILE_LOCK:
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: CUDA calls of other threads (a DataLoader's pinning thread) do
                # not invalidate this capture
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), \
                        self._scope():
                    self.static_outputs = fn(*self.static_inputs)
            except Exception as exc:  # cudaErrorStreamCapture*, or the forward's own error
                _release_rng_capture(torch.cuda.current_device())
                self.close()
                raise CaptureError(condense(f"{type(exc).__name__}: {exc}", limit=300)) from exc
        self._spare = self._spare_outputs = None  # a recapture drops the old spare graph
        self._storages = self._handed_out_storages() if self.copy_outputs else None
        self._sole_use = self._use_counts()

    def _handed_out_storages(self) -> list[int] | None:
        """The storages (``_cdata`` pointers) of the output buffers, which calls hand out while
        nothing holds the last ones; ``None`` when they are never handed out: this torch cannot
        count their references, or an output aliases a static input, which every call
        overwrites before replaying."""
        if not hasattr(torch._C, "_storage_Use_Count"):
            return None
        outputs = [t for t in tree_flatten(self.static_outputs)[0] if isinstance(t, torch.Tensor)]
        inputs = {a.untyped_storage().data_ptr() for a in self.static_inputs
                  if isinstance(a, torch.Tensor)}
        if any(t.untyped_storage().data_ptr() in inputs for t in outputs):
            return None
        return [t.untyped_storage()._cdata for t in outputs]

    def _use_counts(self) -> tuple[int, ...] | None:
        """How many references each handed-out storage has now (the runner's own while nothing
        else holds them)."""
        if self._storages is None:
            return None
        return tuple(torch._C._storage_Use_Count(cdata) for cdata in self._storages)

    def _replay_spare(self, args: Sequence[Any]) -> Any:
        """Outputs for a call made while something holds buffers handed out earlier: the spare
        graph's (captured now if this is its first use), copied. It shares the main graph's
        memory pool: the two never run at once, and the main graph's outputs were alive at its
        capture, so it never writes them. When it cannot be captured now (a background compile
        holds :data:`~.tiered.COMPILE_LOCK`) or at all, the call runs ``fn`` without a graph."""
        if self._spare is None and COMPILE_LOCK.acquire(blocking=False):
            spare = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(spare, pool=self.graph.pool(),
                                      capture_error_mode="thread_local"), self._scope():
                    self._spare_outputs = self.fn(*self.static_inputs)
                self._spare = spare
            except Exception:  # noqa: BLE001 - uncaptured calls are the way out
                _release_rng_capture(torch.cuda.current_device())
                self._spare = False
            finally:
                COMPILE_LOCK.release()
        if not self._spare:
            return self.fn(*args)
        self._spare.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                        self._spare_outputs)

    def _scope(self) -> contextlib.AbstractContextManager:
        """Host caches per parameter version may be read by the graph when a guard recaptures
        on parameter changes; otherwise their work must be captured."""
        return parameters_guarded() if self.guard is not None else contextlib.nullcontext()

    def __call__(self, *args: Any) -> Any:
        if self.guard is not None and self.guard() != self.token:
            self._capture()
        for static, a in zip(self.static_inputs, args):
            if isinstance(static, torch.Tensor):
                static.copy_(a)
        if self._sole_use is not None and self._use_counts() != self._sole_use:
            return self._replay_spare(args)  # a buffer (or a view of it) handed out is held
        self.graph.replay()
        if not self.copy_outputs:
            return self.static_outputs
        if self._sole_use is None:  # buffers never handed out
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                            self.static_outputs)
        # new tensor objects on the buffers: each one held adds to its storage's count
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                        self.static_outputs)

    def close(self) -> None:
        """Free the graph, its memory pool and the static buffers (the runner is unusable after)."""
        for graph in (self._spare, self.graph):
            if graph:
                graph.reset()
        self.graph = self._spare = None
        self.static_inputs, self.static_outputs, self._spare_outputs = [], None, None
