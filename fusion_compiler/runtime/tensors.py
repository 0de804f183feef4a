"""Tensor utilities the runners and kernels share: buffers given back their values after work that
must not move them, gradients laid out like their parameters, channel views of wider tensors, the
order of uses of memory from several streams, the turns threads take over a graph's buffers, and
the side streams this package issues its own work on."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["StreamOrder", "Turns", "side_stream", "stream_capturing", "capture_owner",
           "output_leaves", "owning_capture", "autocast_dtype", "shared_storage", "restored",
           "inference_graph_modes", "layout_like", "channel_view_strides", "as_channel_view",
           "before_captures_on_a_thread", "ready_to_capture", "on_device_of"]


def stream_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (``False`` without
    CUDA): then work may only be issued, not waited for, and no graph may be replayed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_NOTHING = contextlib.nullcontext()


def on_device_of(ref: torch.Tensor | None, args: Sequence[Any] = ()
                 ) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(i)`` when ``ref`` (``None``: the first tensor of ``args``) is on CUDA
    device ``i`` and the current device is another; nothing otherwise.

    Eager PyTorch runs an op on its tensors' device and that device's current stream, whatever
    the current device; this package's runners take the current device's streams (the capture
    stream, the caller's stream a graph replays on), and Triton launches on the current device.
    A model on ``cuda:1`` called while the current device is ``cuda:0`` (no
    ``torch.cuda.set_device(1)``: an RL actor on a second GPU) would capture on a stream of the
    wrong device, where the ops on ``cuda:1`` tensors run outside the capture. Entered around
    every call, compile and tier switch of a compiled module."""
    t = ref if ref is not None else next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None or not t.is_cuda:
        return _NOTHING
    index = t.get_device()
    return _NOTHING if index == torch.cuda.current_device() else torch.cuda.device(index)


_PREPARERS: list[Callable[[int], None]] = []
_PREPARED = threading.local()  # device index -> how many of _PREPARERS ran on this thread


def before_captures_on_a_thread(prepare: Callable[[int], None]) -> None:
    """Register ``prepare(index)``, run by :func:`ready_to_capture` once per thread and device:
    it makes the per-thread state of a library (a handle) for device ``index`` on the calling
    thread, with nothing being captured."""
    _PREPARERS.append(prepare)


def _torch_library_handles(index: int) -> None:
    """PyTorch's own cuDNN and cuBLAS handles of device ``index`` for the calling thread (PyTorch
    keeps one per thread and makes it at the thread's first convolution or GEMM): two tiny
    operations on the current stream. One that PyTorch refuses (a GEMM under
    ``torch.use_deterministic_algorithms(True)`` without ``CUBLAS_WORKSPACE_CONFIG``) is left
    out: the forward meets the same refusal itself, where it runs such an op."""
    x = torch.ones(1, 1, 1, 1, device=torch.device("cuda", index))
    for op in (torch.nn.functional.conv2d, lambda a, b: torch.mm(a.view(1, 1), b.view(1, 1))):
        try:
            op(x, x)
        except RuntimeError:
            pass


def ready_to_capture(index: int) -> None:
    """Make what the libraries keep per thread (PyTorch's cuDNN and cuBLAS handles, and those of
    :func:`before_captures_on_a_thread`) for device ``index`` on the calling thread, once, before
    it begins a CUDA graph capture. A handle made inside a capture fails: cuDNN's
    ``cudnnCreate`` allocates its persistent buffer with ``cudaMalloc``, which a capture in
    ``thread_local`` mode refuses on the capturing thread and which invalidates the capture
    (measured on an H200, torch 2.11, cuDNN 9.19: a second thread's first capture failed so;
    docs/decisions.md, "A thread's first capture"). No-op while the current stream is
    capturing."""
    done = getattr(_PREPARED, "devices", None)
    if done is None:
        done = _PREPARED.devices = {}
    preparers = [_torch_library_handles, *_PREPARERS]
    if done.get(index, 0) == len(preparers):
        return
    with torch.cuda.device(index):
        if stream_capturing():
            return
        for prepare in preparers[done.get(index, 0):]:
            prepare(index)
    done[index] = len(preparers)


_CAPTURE = threading.local()
_OWNED_STREAMS: dict[int, Any] = {}  # raw stream in one of this package's captures -> its owner
_OWNED_LOCK = threading.Lock()


def _raw_stream() -> int | None:
    """The current CUDA stream of the current device as a raw ``cudaStream_t`` (``None``
    without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def capture_owner() -> Any:
    """What owns the CUDA graph being captured now by this package (:func:`owning_capture`), or
    ``None``: the key of the scratch memory that graph's kernels use (the cuDNN backend's
    workspaces, :class:`fusion_compiler.backends.cudnn.resources.Workspaces`), so that graphs
    which may be replayed at the same time never share it, whichever stream they are captured on.

    The capturing thread finds its owner on any stream; another thread (autograd's device
    thread, which runs the backward of a captured training step) by its current stream, which
    is one the capturing thread has been on during the capture."""
    owner = getattr(_CAPTURE, "owner", None)
    stream = _raw_stream()
    if stream is None:
        return owner
    with _OWNED_LOCK:
        if owner is not None:
            _OWNED_STREAMS.setdefault(stream, owner)
            return owner
        return _OWNED_STREAMS.get(stream)


@contextlib.contextmanager
def owning_capture(owner: Any) -> Iterator[None]:
    """Make ``owner`` this thread's :func:`capture_owner` while the block runs, and that of
    other threads on the current stream (enter it on the capture stream, inside the capture).
    ``owner``: an object that outlives the graph and is shared only by graphs that never replay
    at the same time (a runner's :class:`Turns`)."""
    before = getattr(_CAPTURE, "owner", None)
    _CAPTURE.owner = owner
    capture_owner()  # the capture stream is known to other threads from now on
    try:
        yield
    finally:
        _CAPTURE.owner = before
        with _OWNED_LOCK:
            for stream in [s for s, o in _OWNED_STREAMS.items() if o is owner]:
                del _OWNED_STREAMS[stream]


_SIDE_STREAMS: dict[tuple[str, int], torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()


def side_stream(purpose: str) -> torch.cuda.Stream:
    """This package's own stream for ``purpose`` on the current device, made once and kept (every
    thread gets the same one). Like every stream torch makes, it is a non-blocking stream
    (``cudaStreamNonBlocking``): work on it never orders itself against the legacy default stream,
    and a capture on it never makes a legacy-stream call of another thread fail (CUDA Runtime API,
    "Stream synchronization behavior"; docs/decisions.md, "cuDNN deserialization captures").
    Of the default priority (inference graphs are captured on high-priority streams of their
    own: :func:`.replays.capture_stream`)."""
    key = (purpose, torch.cuda.current_device())
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get(key)
        if stream is None:
            stream = _SIDE_STREAMS[key] = torch.cuda.Stream(key[1], priority=0)
    return stream


_PER_THREAD_STREAM = 2
"""``cudaStreamPerThread``'s handle (CUDA Runtime API, ``driver_types.h``)."""


class StreamOrder:
    """Uses of some GPU memory from whichever CUDA stream is current, kept in order: a use on
    another stream than the previous use's first makes the current stream wait for the work
    queued so far on that one (which may still read or write the memory: the host's order alone
    does not order two streams; CUDA Runtime API, "Stream synchronization behavior").

    Args:
        device: the memory's device; nothing is followed for a device other than CUDA.
    """

    def __init__(self, device: torch.device):
        self._device = device
        self._last: tuple[Any, torch.cuda.Stream] | None = None  # the previous use's (key, stream)

    def follow(self) -> None:
        """Order a use on the current stream after the previous use (call it before the use).

        ``cudaStreamPerThread`` (handle 2, what CuPy's and Numba's per-thread default streams
        hand to ``torch.cuda.ExternalStream``) is a stream of its own in every host thread, and
        no other thread can name it: a use there is keyed by its thread too, and a use after
        another thread's use there waits for the whole device (``torch.cuda.synchronize``)."""
        if self._device.type != "cuda":
            return
        raw = torch._C._cuda_getCurrentRawStream(self._device.index)
        key = (raw, threading.get_ident()) if raw == _PER_THREAD_STREAM else raw
        if self._last is None or self._last[0] != key:
            stream = torch.cuda.current_stream(self._device)
            if self._last is not None:
                if isinstance(self._last[0], tuple):  # another thread's per-thread stream
                    torch.cuda.synchronize(self._device)
                else:
                    stream.wait_stream(self._last[1])
            self._last = (key, stream)


class Turns:
    """Calls that share buffers (a CUDA graph's static inputs, outputs and activations), one at a
    time and in stream order.

    :meth:`turn` holds a re-entrant lock, so that one thread's copies into the buffers, replay
    and copies out are never interleaved with another's; and a turn taken on another CUDA stream
    than the last one first makes that stream wait for the last (:class:`StreamOrder`).

    Args:
        device: the buffers' device; streams are followed only for a CUDA device.
    """

    def __init__(self, device: torch.device):
        self.lock = threading.RLock()
        self._order = StreamOrder(device)

    def turn(self) -> "Turns":
        """Hold the buffers for one call, on the current stream (``with turns.turn():``)."""
        return self

    def __enter__(self) -> None:
        self.lock.acquire()
        try:
            self._order.follow()
        except BaseException:
            self.lock.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """Hold the buffers to free them: after any call of another thread, the current stream
        waiting for the last call's work; not while the current stream is being captured (the
        caller's own CUDA graph), where a wait on a stream outside the capture would pull that
        stream into it."""
        with self.lock:
            if not stream_capturing():
                self._order.follow()
            yield


def inference_graph_modes(inference: bool) -> contextlib.ExitStack:
    """Inside ``torch.inference_mode()`` with ``inference`` (else outside it), gradients off: the
    modes an inference specialization's graphs are compiled and captured in, whatever the
    caller's (tensors made inside inference mode are inference tensors, as eager's outputs there;
    docs of ``torch.inference_mode``)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(inference))
    stack.enter_context(torch.no_grad())  # after it: leaving inference mode turns grad mode on
    return stack


def autocast_dtype(args: Sequence[Any]) -> torch.dtype | None:
    """The ``torch.autocast`` dtype active for the device of the first tensor of ``args`` (the
    CPU where there is none), or ``None``."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def shared_storage(args: Sequence[Any], state: frozenset[int] = frozenset()) -> bool:
    """Whether two tensors of ``args`` are views of one storage (``x`` and ``x[1:]``), or one
    is a view of a storage in ``state`` (addresses: the model's parameters and buffers)."""
    storages = [a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)]
    return len(set(storages)) < len(storages) or not state.isdisjoint(storages)


@contextlib.contextmanager
def restored(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Give ``tensors`` back their values on exit (one copy each, taken on entry; tensors made
    under ``inference_mode`` cannot be written and are left out): for work that runs a model
    without meaning to, which must not move batch norm's running statistics. The values are
    written through ``.data``, which leaves the tensors' version counters as they were: an
    autograd graph of an earlier call that saved one of them (its values unchanged) still runs
    its backward."""
    tensors = [t for t in dict.fromkeys(tensors) if not t.is_inference()]  # each once
    with torch.no_grad():
        saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(tensors, saved):
                t.data.copy_(s)


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


def channel_view_strides(shape: Sequence[int], total: int) -> tuple[int, ...]:
    """Strides (elements) of ``[N, C, H, W]`` channels of a fully packed channels_last tensor of
    ``total >= C`` channels: ``(H*W*total, 1, W*total, total)``."""
    _, _, h, w = shape
    return (h * w * total, 1, w * total, total)


def as_channel_view(x: torch.Tensor, total: int, alignment: int = 16) -> torch.Tensor:
    """``x`` ``[N, C, H, W]`` laid out as ``C`` channels of a channels_last tensor of ``total``
    channels (:func:`channel_view_strides`), its data ``alignment``-byte aligned: ``x`` itself
    when it already is (a ``narrow`` of a wider channels_last tensor), else a copy into the first
    channels of a new such tensor. What a kernel planned for that layout reads."""
    strides = channel_view_strides(x.shape, total)
    if x.stride() == strides and x.data_ptr() % alignment == 0:
        return x
    n, c, h, w = x.shape
    wide = torch.empty((n, total, h, w), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last)
    return wide.narrow(1, 0, c).copy_(x)


def output_leaves(out: Any) -> tuple[list[Any], Any]:
    """``torch.utils._pytree.tree_flatten`` of a model's outputs with each ``torch.Size`` one
    leaf: flattened, it came back a plain tuple (``isinstance(s, torch.Size)`` false)."""
    return tree_flatten(out, is_leaf=lambda t: isinstance(t, torch.Size))
