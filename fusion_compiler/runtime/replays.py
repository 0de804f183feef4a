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
by what the graph draws; two replays that do not move it, with the generator's state the one the
graph registered: :func:`release_rng_capture`); until then it is taken to draw. (This is torch
2.11's behaviour; later torch keeps these tensors per capture, where replaying alone costs only
speed.) A capture of this package takes its turn as a replay taken alone: its start fills the
same tensors (:func:`capture_turn`). Measurements and history: docs/decisions.md, "Replays one
at a time" and "Captures take their turn; a failed capture keeps the generator's state"."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

from .background import COMPILE_LOCK, warn_once

__all__ = ["GraphTurn", "capture_stream", "capture_turn", "release_rng_capture"]


class _Replays:
    """The replays of one device's graphs: a lock, the event after the last replay of each lane
    (by raw stream) and after the last replay taken alone, each with the key of the stream it
    was recorded on (:func:`_current_stream`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lanes: dict[int, list[Any]] = {}  # lane: [event, stream key]
        self.alone: list[Any] | None = None


_REPLAYS: dict[int, _Replays] = {}
_LOCK = threading.Lock()


def _replays(index: int) -> _Replays:
    with _LOCK:
        return _REPLAYS.setdefault(index, _Replays())


_STREAM_OBJECTS: dict[tuple, torch.cuda.Stream] = {}


def _current_stream(index: int) -> tuple[tuple, torch.cuda.Stream]:
    """The current stream of device ``index``: its key (stream id, device index, device type, as
    ``torch.cuda.current_stream`` reads them) and a ``torch.cuda.Stream`` of that key, kept per
    key (a stream object is its key; ``torch.cuda.current_stream`` makes a new one at every
    call: docs/decisions.md, "The host path of a replay")."""
    torch.cuda._lazy_init()  # (PyTorch's own error in a forked process, not CUDA's)
    key = torch._C._cuda_getCurrentStream(index)
    stream = _STREAM_OBJECTS.get(key)
    if stream is None:
        if len(_STREAM_OBJECTS) >= 1024:  # a program that makes streams without end
            _STREAM_OBJECTS.clear()
        stream = _STREAM_OBJECTS[key] = torch.cuda.current_stream(index)
    return key, stream


def _torch_stream(key: tuple) -> bool:
    """Whether a stream key names one stream of PyTorch's own: the default stream (id 0) or a
    pool stream (odd ids; never destroyed). An external stream's id is its ``cudaStream_t``
    (even), which need not name one stream: ``cudaStreamPerThread`` is another stream in every
    host thread, and a destroyed stream's handle may come back for a new one (c10
    ``CUDAStream.cpp``, stream ids)."""
    return key[0] == 0 or bool(key[0] & 1)


def _wait(stream: Any, key: tuple, mark: list[Any] | None) -> None:
    """Make ``stream`` (of key ``key``) wait for ``mark``'s event, unless that was recorded on
    this very stream, PyTorch's own, whose order already puts it before what comes next."""
    if mark is not None and (mark[1] != key or not _torch_stream(key)):
        stream.wait_event(mark[0])


def _mark(stream: Any, key: tuple, mark: list[Any] | None) -> list[Any]:
    """Record ``mark``'s event (a new one if ``mark`` is ``None``) on ``stream``."""
    if mark is None:
        mark = [torch.cuda.Event(), key]
    mark[0].record(stream)
    mark[1] = key
    return mark


RELEASES = [0]
"""How many times the default generator's state was replaced after a failed capture (the
fallback of :func:`release_rng_capture`): graphs captured before keep the old state, whose
offset :func:`_offset` no longer reads, so such a graph is taken to draw."""


@contextlib.contextmanager
def capture_turn(stream: torch.cuda.Stream) -> Iterator[None]:
    """Hold the replays of ``stream``'s device during a capture on ``stream`` (``with
    capture_turn(stream):`` around ``capture_begin`` to ``capture_end``), as a replay taken
    alone is held: ``stream`` first waits for the last replay of every lane and the last one
    taken alone, and the event recorded on it after the capture is the one every later replay
    waits for. Other threads' replays on the device wait until the capture ends.

    Why: ``capture_begin`` fills the default generator's seed and offset tensors on the capture
    stream (its capture prologue sets the offset to 0), the tensors the kernels of a replay that
    draws read (torch 2.11 keeps one pair per generator state, see the module docstring). That
    fill landing while such a replay runs would hand its later kernels offset 0, the numbers an
    earlier replay drew, without any error."""
    replays = _replays(stream.device.index)
    key = (stream.stream_id, stream.device_index, stream.device_type)
    with replays.lock:
        for mark in [*replays.lanes.values(), replays.alone]:
            _wait(stream, key, mark)
        try:
            yield
        finally:  # the capture has ended (or never began): a real record, after the fill
            replays.alone = _mark(stream, key, replays.alone)


def release_rng_capture(device: int) -> None:
    """Take the default CUDA generator of ``device`` out of capture mode after a failed capture,
    keeping its state.

    ``CUDAGraph.capture_end`` runs the generators' capture epilogue only when the capture
    succeeded; after a failed one the generator's state stays in capture mode and the next random
    op outside a capture raises "Offset increment outside graph capture encountered
    unexpectedly". A capture of one small kernel on a stream of ``device`` runs the prologue and
    the epilogue on that same state (PyTorch ``CUDAGeneratorState::capture_prologue`` and
    ``capture_epilogue``): the graphs captured before, which registered it, and eager draws go
    on taking offsets from one counter. (A copy of the state put in its place, as this package
    did before, left the older graphs the old state, still in capture mode: a replay of one that
    draws raised that error.) The capture holds :data:`~.background.COMPILE_LOCK`, as every
    capture of this package does (its prologue would reset another capture's count of what it
    draws), and takes its :func:`capture_turn`. Where even it fails, the state is replaced by a
    copy after all, with one WARNING.

    Raises:
        nothing: a failure of both ways is logged and left (the next random op raises).
    """
    generator = torch.cuda.default_generators[device]
    try:
        _capture_one_node(device)
        return
    except Exception as exc:  # noqa: BLE001 - the copy below is the fallback
        reason = f"{type(exc).__name__}: {exc}"
    try:
        generator.graphsafe_set_state(generator.clone_state())
    except Exception as exc:  # noqa: BLE001
        reason += f"; replacing its state: {type(exc).__name__}: {exc}"
    RELEASES[0] += 1  # graphs captured before keep the old state: replayed alone from now on
    warn_once("taking the CUDA generator out of capture mode after a failed capture",
              reason[:300] + "; its state was replaced by a copy, so graphs captured before "
              "that draw random numbers may fail")


def _capture_one_node(device: int) -> None:
    """Capture one small kernel on a new stream of ``device`` (an empty graph warns), in its
    :func:`capture_turn`, holding :data:`~.background.COMPILE_LOCK`."""
    with COMPILE_LOCK, torch.cuda.device(device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        graph, node = torch.cuda.CUDAGraph(), torch.empty(1, device=stream.device)
        with capture_turn(stream), torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                node.zero_()
            finally:
                graph.capture_end()


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
        self._replays = _replays(self.device) if self.device is not None else None

    def replaying(self) -> "GraphTurn":
        """Replay the graph inside the block (``with turn.replaying():``), on the current stream:
        after the last replay of its lane and the last replay taken alone; alone (after every
        earlier replay of the device) while it draws random numbers or is not known not to. Costs
        an event record or two per replay, and an event wait for each of those replays that ran
        on another stream; without CUDA (the runners' CPU tests) nothing. The turn holds the
        device's replay lock from the block's start to its end, so a turn's state between the
        two is its own."""
        return self

    def __enter__(self) -> None:
        if self.device is None:  # without CUDA
            return
        replays = self._replays
        replays.lock.acquire()
        try:
            key, stream = self._stream = _current_stream(self.device)
            self._alone = alone = self.random is not False
            if alone:
                for mark in replays.lanes.values():
                    _wait(stream, key, mark)
            else:
                _wait(stream, key, replays.lanes.get(self.lane))
            _wait(stream, key, replays.alone)
            self._before = _offset(self.device) if self.random is None else None
        except BaseException:
            replays.lock.release()
            raise

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if self.device is None:
            return
        replays = self._replays
        try:
            if kind is not None:  # the replay failed: nothing to order after
                return
            if self.random is None:  # not drawing: seen twice (another thread may reseed)
                before = self._before
                after = _offset(self.device) if before is not None else None
                if after is None or after != before or self._releases != RELEASES[0]:
                    self.random = True
                else:
                    self._still += 1
                    self.random = False if self._still >= 2 else None
            key, stream = self._stream
            replays.lanes[self.lane] = _mark(stream, key, replays.lanes.get(self.lane))
            if self._alone:
                replays.alone = _mark(stream, key, replays.alone)
        finally:
            replays.lock.release()


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
