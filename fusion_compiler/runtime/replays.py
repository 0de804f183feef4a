"""The order of this package's CUDA-graph replays on a device: lanes, and the random-number state
every replay touches.

A compiled model's inference graphs (every specialization and tier) are captured on one stream
of their own, :func:`capture_stream`; every model's training steps on one training capture stream
(:class:`~.cuda_graph_training.TrainingGraphRunner`). The stream a graph was captured on is its
*lane*. Replays of one lane run one after another on the GPU, whichever thread or stream issues
them: they share the scratch memory libraries keep per stream and handle (PyTorch's cuBLAS
and cuBLASLt workspaces, made at a thread's first GEMM on a stream and embedded by every graph
captured there: PyTorch ``CublasHandlePool.cpp``), and the tensors the model's derivation prologue
rewrites. Replays of different lanes may run at once (two models called by two threads), except
around a graph that draws random numbers: every replay fills the default CUDA generator's seed and
offset tensors on its stream before its kernels (PyTorch ``CUDAGeneratorImpl``,
``replay_prologue``; every graph registers that generator at capture), and a graph whose kernels
draw read them, so such a graph replays alone: after every earlier replay of any lane, before
any later one. Whether a graph draws is seen at its first replays (the generator's offset moves
by what the graph draws; two replays that do not move it, with no failed capture since the graph
was made); until then it is taken to draw. (This is torch 2.11's behaviour; later torch keeps
these tensors per capture, where replaying alone costs only speed.) Measurements and history:
docs/decisions.md, "Replays one at a time"."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

__all__ = ["GraphTurn", "capture_stream"]


class _Replays:
    """The replays of one device's graphs: a lock, the event after the last replay of each lane
    (by raw stream), and the event after the last replay taken alone."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lanes: dict[int, torch.cuda.Event] = {}
        self.alone: torch.cuda.Event | None = None


_REPLAYS: dict[int, _Replays] = {}
_LOCK = threading.Lock()


def _replays(index: int) -> _Replays:
    with _LOCK:
        return _REPLAYS.setdefault(index, _Replays())


RELEASES = [0]
"""How many times a failed capture replaced the default generator's state
(``cuda_graph._release_rng_capture``): graphs captured before keep the old state, whose offset
:func:`_offset` no longer reads, so such a graph is taken to draw."""


def _offset(index: int) -> int | None:
    """The default CUDA generator's offset on device ``index`` (``None`` where it cannot be
    read: the graph is then always taken to draw)."""
    try:
        return int(torch.cuda.default_generators[index].get_offset())
    except (RuntimeError, IndexError, AttributeError):
        return None


class GraphTurn:
    """How one captured CUDA graph takes its turn among the replays of its device (see the
    module docstring).

    Args:
        stream: the stream the graph was captured on (its lane; its device is the graph's);
            ``None`` without CUDA (the runners' CPU tests: the turn then does nothing).
    """

    def __init__(self, stream: torch.cuda.Stream | None):
        self.device = stream.device.index if stream is not None else None
        self.lane = stream.cuda_stream if stream is not None else None
        self.random: bool | None = None  # whether its replays draw random numbers; None: unknown
        self._still = 0  # first replays seen not to move the offset (two are needed)
        self._releases = RELEASES[0]

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Replay the graph inside the block, on the current stream: after the last replay of its
        lane and the last replay taken alone; alone (after every earlier replay of the device)
        while it draws random numbers or is not known not to. Costs an event wait or a few, and a
        record or two, per replay; without CUDA (the runners' CPU tests) nothing."""
        if self.device is None or not torch.cuda.is_available():
            yield
            return
        replays = _replays(self.device)
        with replays.lock:
            stream = torch.cuda.current_stream(self.device)
            alone = self.random is not False
            waits = [*replays.lanes.values(), replays.alone] if alone else [
                replays.lanes.get(self.lane), replays.alone]
            for event in waits:
                if event is not None:
                    stream.wait_event(event)
            before = _offset(self.device) if self.random is None else None
            yield
            if self.random is None:  # not drawing: seen twice (another thread may reseed)
                after = _offset(self.device) if before is not None else None
                if after is None or after != before or self._releases != RELEASES[0]:
                    self.random = True
                else:
                    self._still += 1
                    self.random = False if self._still >= 2 else None
            done = replays.lanes.get(self.lane)
            if done is None:
                done = replays.lanes[self.lane] = torch.cuda.Event()
            done.record(stream)
            if alone:
                if replays.alone is None:
                    replays.alone = torch.cuda.Event()
                replays.alone.record(stream)


_STREAMS: dict[int, tuple[weakref.ref, dict[int, torch.cuda.Stream]]] = {}
"""By ``id`` of the owner (an owner need not be hashable: a module with ``__eq__`` and no
``__hash__``): a weak reference to it, and its stream per device."""
_STREAMS_LOCK = threading.RLock()  # re-entrant: an owner's death may run ``forget`` under it


def _streams_of(owner: Any) -> dict[int, torch.cuda.Stream]:
    """The owner's streams by device (call with ``_STREAMS_LOCK`` held); forgotten when it
    dies."""
    key = id(owner)
    entry = _STREAMS.get(key)
    if entry is not None and entry[0]() is owner:
        return entry[1]

    def forget(ref: weakref.ref) -> None:
        with _STREAMS_LOCK:
            if _STREAMS.get(key, (None,))[0] is ref:
                del _STREAMS[key]

    entry = _STREAMS[key] = (weakref.ref(owner, forget), {})
    return entry[1]


def capture_stream(owner: Any = None) -> torch.cuda.Stream:
    """The stream this package captures ``owner``'s inference CUDA graphs on, on the current
    device: one per owner (the model a compiled module compiles: its graphs share the tensors its
    derivation prologue rewrites) and device, made at the first ask and kept while the owner
    lives; with ``owner`` ``None``, a new one. Of the highest priority the device offers
    (``torch.cuda.Stream.priority_range()``): the graphs' kernels become nodes of that priority,
    which the GPU schedules before those of the derivation beside the forward, on a stream of the
    default priority. PyTorch hands streams out of a pool of 32 per priority and device (round
    robin), so two owners may get one stream; their graphs then share a lane, which keeps them in
    turn. (Training steps of every model share one stream of the default priority:
    :class:`~.cuda_graph_training.TrainingGraphRunner`.)"""
    index = torch.cuda.current_device()
    priority = torch.cuda.Stream.priority_range()[1]
    if owner is None:
        return torch.cuda.Stream(index, priority=priority)
    with _STREAMS_LOCK:
        streams = _streams_of(owner)
        stream = streams.get(index)
        if stream is None:
            stream = streams[index] = torch.cuda.Stream(index, priority=priority)
    return stream
