"""What executing a cuDNN plan needs besides the plan: a handle and a workspace, safe to use from
several threads and streams at once.

**Handles: one per thread and device.** A cuDNN handle carries the stream its work is issued on,
and the cuDNN library is thread-safe only "so long as the threads do not share the same cuDNN
handle simultaneously" (cuDNN Developer Guide, "Thread Safety"). With one handle per device, any
other thread asking for the handle (this package's background thread loading plans, a user's
second thread calling a compiled model) set its own stream between a caller's ``set_stream`` and
its ``execute``: the plan then ran on the other thread's stream, outside a CUDA graph being
captured, or out of order with the caller's work. A thread keeps the handles it was given until
it ends; they then return to a free list for the next thread (as PyTorch's own cuDNN handle pool
does), so short-lived threads create no more handles than run at once. A plan built or
deserialized with one handle runs with another of the same device (PyTorch executes the plans of
its cuDNN benchmark cache that way).

**Workspaces: one per device and stream.** Plans executed on one stream run one after another and
can share a workspace; plans on two streams (two threads, or a capture stream beside the default
one) would overwrite each other's scratch. A workspace only grows. It is allocated on the stream
it serves, so once freed, PyTorch's caching allocator gives its memory only to work ordered after
it on that stream: a device can keep just the workspaces of its :data:`STREAMS_KEPT` streams used
last and free the others (short-lived streams: the side stream of a capture's warm-up). A
workspace handed out while its stream was being captured into a CUDA graph is never freed
(docs/decisions.md, "cuDNN workspaces a CUDA graph used are kept"). The graphs this package
captures get workspaces of their own instead, one set per owner (a runner's graphs, which replay
one at a time). Graphs of two models, on two capture streams, replay at once, and graphs of two
owners of one model share its stream: two graphs sharing a stream's workspace and replayed at
once by two threads would overwrite each other's scratch (docs/decisions.md, "A workspace per
captured graph").
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

__all__ = ["HandlePool", "Workspaces", "STREAMS_KEPT"]

STREAMS_KEPT = 4
"""Workspaces a device keeps for streams no CUDA graph captured (the streams used last)."""


class _Held:
    """The handles one thread holds, by device index; back to the pool when the thread ends
    (``threading.local`` drops a thread's values then)."""

    def __init__(self, pool: "HandlePool"):
        self.pool = pool
        self.handles: dict[int, Any] = {}

    def __del__(self) -> None:
        self.pool._release(self.handles)


class HandlePool:
    """cuDNN handles, one per (thread, device): see the module docstring.

    Args:
        create: ``create(index)`` makes a new handle for device ``index``
            (``cudnn.create_handle`` with that device current).
        set_stream: ``set_stream(handle, raw_stream)`` (``cudnn.set_stream``).
    """

    def __init__(self, create: Callable[[int], Any], set_stream: Callable[[Any, int], None]):
        self._create, self._set_stream = create, set_stream
        self._local = threading.local()
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def get(self, index: int, stream: int) -> Any:
        """The calling thread's handle of device ``index``, its stream set to ``stream`` (a raw
        ``cudaStream_t``, as ``torch.cuda.current_stream().cuda_stream``)."""
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = _Held(self)
        h = held.handles.get(index)
        if h is None:
            with self._lock:
                free = self._free.get(index)
                h = free.pop() if free else None
            if h is None:
                h = self._create(index)
            held.handles[index] = h
        self._set_stream(h, stream)
        return h

    def _release(self, handles: dict[int, Any]) -> None:
        with self._lock:
            for index, h in handles.items():
                self._free.setdefault(index, []).append(h)


def _weakly_referenced(owner: Any) -> bool:
    try:
        weakref.ref(owner)
    except TypeError:
        return False
    return True


class Workspaces:
    """Workspaces by (device index, stream): see the module docstring."""

    def __init__(self) -> None:
        self._current: dict[tuple[int, int], torch.Tensor] = {}
        self._captured: set[tuple[int, int]] = set()  # slots a CUDA graph has used
        self.retired: list[torch.Tensor] = []  # replaced ones a CUDA graph has used: kept
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> slots
        self._lock = threading.Lock()

    def get(self, device: torch.device, stream: int, nbytes: int, capturing: bool,
            owner: Any = None) -> torch.Tensor:
        """A workspace of at least ``nbytes`` bytes (uint8) on ``device`` (its index given) for
        work on ``stream`` (a raw ``cudaStream_t``, the current one of ``device``), kept and
        reused, and never freed from now on if ``capturing`` (``stream`` is being captured into
        a CUDA graph); see the module docstring. ``owner``: what owns the graph being captured
        (:func:`fusion_compiler.runtime.tensors.capture_owner`; ``None`` for a capture of the
        caller's own), which gets workspaces of its own, allocated in the capture (from the
        graph's memory pool) and kept as long as the owner lives; an owner that takes no weak
        reference gets the stream's."""
        index = device.index
        slot = (index, stream)
        if capturing and owner is not None and _weakly_referenced(owner):
            return self._owned_workspace(owner, slot, device, nbytes)
        with self._lock:
            ws = self._current.pop(slot, None)  # re-inserted last: the order is of last use
            if ws is None or ws.numel() < nbytes:
                if ws is not None and slot in self._captured:
                    self.retired.append(ws)
                    self._captured.discard(slot)
                ws = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
                self._current[slot] = ws
                self._evict(index)
            else:
                self._current[slot] = ws
            if capturing:
                self._captured.add(slot)
            return ws

    def _owned_workspace(self, owner: Any, slot: tuple[int, int], device: torch.device,
                         nbytes: int) -> torch.Tensor:
        """``owner``'s workspace for ``slot``, grown by adding one of at least twice the size
        (the smaller ones stay: kernels captured before use them), so that what an owner holds is
        less than twice its largest request."""
        with self._lock:
            held = self._owned.setdefault(owner, {}).setdefault(slot, [])
            if not held or held[-1].numel() < nbytes:
                size = max(nbytes, 2 * held[-1].numel() if held else 1)
                held.append(torch.empty(size, dtype=torch.uint8, device=device))
            return held[-1]

    def _evict(self, index: int) -> None:
        """Free the workspaces of ``index``'s streams beyond the :data:`STREAMS_KEPT` used last
        (captured ones stay)."""
        free = [slot for slot in self._current if slot[0] == index and slot not in self._captured]
        for slot in free[:max(0, len(free) - STREAMS_KEPT)]:
            del self._current[slot]
