"""Replay a whole compiled forward as one CUDA graph (``torch.cuda.CUDAGraph``).

The forward is warmed up on a side stream (so every cuDNN plan is built and Inductor's kernels
compiled before capture: ``execute()`` must not build inside a capture, docs/cudnn.md, "Executing
a plan"), then captured once; the graph's cuDNN workspaces are its own, allocated in the capture
(:func:`capturing`). Each call copies the inputs into static
buffers and replays.

Inputs: a call copies its tensors into the graph's input buffers (a device copy each, a kernel of
its own; measurements: docs/decisions.md, "The direct graph for inputs passed again"). A caller that
passes the very tensors of its previous call again (same addresses and strides: it refilled them in
place, as a batch simulator refills its observation buffer) gets, at that second call, a *direct*
graph captured on those tensors, which reads them where they are: no input copy for as long as the
caller keeps passing them. It has a memory pool of its own (one more set of the forward's
intermediate buffers); only the first tensors so reused get one, and a call with any others takes
the copying graph. (With the caching allocator a new tensor often lands where the last call's freed
one was: a direct graph then serves a caller that makes a new input each call.)

Outputs: a later call never overwrites what an earlier one returned. A call hands out the graph's
output buffers themselves (as new tensor objects) when nothing holds what the previous call handed
out: the buffers' storages are then referenced by the runner alone (``torch._C._storage_Use_Count``,
the check Inductor's CUDA graph trees make on their outputs). When something still does (the output,
or a view of it), the call replays a spare graph, captured at the first such call in the main
graph's memory pool, whose outputs never leave the runner, and returns copies of them (one device
copy per output, on the current stream). A copy on every call costs a kernel of its own after the
graph; handing out the buffers costs nothing (measurements: docs/decisions.md, "CUDA-graph outputs
handed out or copied"). An output that is an input, or a view of one, is the caller's tensor (or
that view of it), as in eager (:class:`~.captured.CapturedForward`); a call whose tensor such a
view cannot be taken of (other strides than the capture's) runs the forward without a graph.

A forward that cannot be captured (a host synchronization such as ``.item()``, a copy from pageable
host memory, data-dependent shapes) raises :class:`CaptureError` at construction; the caller then
runs it without a graph.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from ..ir.errors import condense
from .derivations import Derivations
from .background import COMPILE_LOCK, gc_paused, warn_once
from .replays import capture_stream, capture_turn, release_rng_capture
from .captured import CapturedForward
from .tensors import Turns, inference_graph_modes, owning_capture, ready_to_capture, restored
from .weight_cache import Epoch, derivation_scope

__all__ = ["CudaGraphRunner", "CaptureError"]


class CaptureError(RuntimeError):
    """The forward could not be captured in a CUDA graph; the message says why (CUDA's error)."""


def _normal_tensors(state: Sequence[torch.Tensor] = ()) -> contextlib.AbstractContextManager:
    """Inference mode off, gradients off, while a runner that takes the caller's modes
    (``CudaGraphRunner(inference=None)``) makes its input buffers and runs its warm-ups: normal
    tensors take writes in and outside ``torch.inference_mode()``, inference tensors only inside
    it (PyTorch's inference-mode rules, docs of ``torch.inference_mode``). Inference mode stays on
    where ``state`` (what the forward writes, such as a batch norm's statistics) holds inference
    tensors."""
    if not torch.is_inference_mode_enabled() or any(
            isinstance(t, torch.Tensor) and t.is_inference() for t in state):
        return contextlib.nullcontext()
    return inference_graph_modes(False)


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, owner: Any, pool: Any = None,
              stream: torch.cuda.Stream | None = None, turn: bool = True):
    """``torch.cuda.graph(graph, pool, stream)`` as every runner captures: with
    ``capture_error_mode="thread_local"`` (CUDA calls of other threads, such as a DataLoader's
    pinning thread, do not invalidate the capture), Python's cyclic garbage collector paused
    (:func:`~.background.gc_paused`), autocast's cast cache off (:func:`_uncached_autocast`) and
    ``owner`` (the runner's :class:`~.tensors.Turns`: its graphs replay one at a time) the
    :func:`~.tensors.capture_owner` of the capture, whose scratch memory no other runner's
    graphs share. The libraries' per-thread handles are made first (:func:`~.tensors.
    ready_to_capture`): a thread's first capture would otherwise make them inside it, and fail.
    The device's replays wait while it captures (:func:`~.replays.capture_turn`), unless
    ``turn`` is false: for a body that waits for another thread, such as autograd's device
    thread, which may itself be waiting for that turn in a replay. After a failure, the
    caller's stream is current again (``torch.cuda.graph`` leaves its own current when
    ``capture_end`` raises) and the CUDA generator out of capture mode
    (:func:`~.replays.release_rng_capture`)."""
    stream = stream if stream is not None else capture_stream()
    ready_to_capture(stream.device.index)
    before = torch.cuda.current_stream()
    try:
        with capture_turn(stream) if turn else contextlib.nullcontext(), gc_paused(), \
                _uncached_autocast(), torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"), \
                owning_capture(owner):
            yield
    except BaseException:
        torch.cuda.set_stream(before)
        release_rng_capture(stream.device.index)
        raise


def _uncached_autocast() -> contextlib.AbstractContextManager:
    """A live CUDA ``torch.autocast``, same dtype, with its cast cache off (nothing otherwise).

    Autocast keeps the low-precision cast of an fp32 leaf tensor that requires gradients (a
    parameter) until the outermost autocast region exits (``aten/src/ATen/autocast_mode.cpp``,
    ``cached_cast``). A capture that found a cast made before it (in the warm-up, or by the
    caller's own code in the same region) would hold no cast kernel: every replay would read
    that one tensor, stale after the parameter changes and freed when the region exits. PyTorch's
    documentation of ``torch.cuda.make_graphed_callables`` asks for ``cache_enabled=False`` under
    autocast for the same reason."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


class CudaGraphRunner:
    """Capture ``fn(*example_args)`` in a CUDA graph; call with inputs of the same shapes/dtypes.

    Args:
        fn: the forward to capture; it must only launch work on the current stream.
        example_args: real CUDA tensors (their values are used for the warm-up runs).
        warmup: eager runs before capture.
        derivations: what the forward derives from the module's state (hoisted values, kernels'
            weight copies): warm-up and capture run in its scope, and every graph starts with its
            prologue, which recomputes the derived tensors whose sources changed since the last
            replay (:mod:`.derivations`). ``None``: values the kernels derive are made once per
            capture, in the graph, at every replay.
        buffers: the module's state the forward may write (its buffers, and its parameters
            where the graph writes in place): what the warm-up calls update in them (a
            train-mode batch norm's statistics, a forward's ``self.gate.mul_(0.5)``) is undone,
            so that calls update them as eager calls do.
        written: positions of inputs the forward writes in place: after a replay that read the
            input buffers, they are copied into the caller's tensors.
        inference: the mode of the specialization the runner serves, whatever the caller's when
            it is built or captures again: ``True`` captures inside ``torch.inference_mode()``
            (output buffers are inference tensors, as eager's outputs are there), ``False``
            outside it; gradients off in both. Input buffers and derived tensors are normal
            tensors either way. ``None``: the caller's modes (a captured training step).
        model: the compiled model the graphs belong to: they are captured on its stream
            (:func:`~.replays.capture_stream`), so the graphs of one model replay in turn and
            those of two models may replay at once (:mod:`.replays`); ``None``: on a new stream.
        state: the model's parameters and buffers: an output that is one of them (or a view of
            one) is handed out as that tensor, as eager returns it, not as a copy.

    A call made while the current stream is being captured (the caller's own CUDA graph) runs
    the forward, prologue included, into that capture: a graph cannot be replayed inside one.
    Calls from several threads run one at a time (each fills the input buffers, replays and
    hands out the output buffers in turn), and a call on another stream than the last one
    first waits for that stream's work, which may still read the buffers the replay rewrites; a
    replay also waits for the stream its graph's outputs were last handed out on (work queued
    there on them may outlive the caller's hold on them).

    Raises:
        CaptureError: the forward cannot be captured (the graph is discarded).
    """

    def __init__(self, fn: Callable[..., Any], example_args: Sequence[Any], warmup: int = 2,
                 derivations: Derivations | None = None,
                 buffers: Sequence[torch.Tensor] = (), written: Sequence[int] = (),
                 inference: bool | None = None, model: Any = None,
                 state: Sequence[torch.Tensor] = ()):
        self.fn, self.warmup, self.derivations = fn, warmup, derivations
        self.state = list(state)
        self.stream = capture_stream(model)
        self.inference = inference
        self.buffers, self.written = list(buffers), list(written)
        self.main: CapturedForward | None = None
        # None: not captured yet; False: capture failed (see _try_capture)
        self._spare: CapturedForward | None | bool = None
        self._direct: CapturedForward | None | bool = None
        self._direct_key: tuple | None = None
        self._last_key: tuple | None = None
        self._epochs: list[Any] = []  # the values each capture derived, kept with its graph
        self._turns = Turns(torch.device("cuda", torch.cuda.current_device()))
        with self._making():
            self.static_inputs = [a.clone() if isinstance(a, torch.Tensor) else a
                                  for a in example_args]
        self._capture()

    def _making(self) -> contextlib.AbstractContextManager:
        """The modes in which the runner makes its input buffers and runs its warm-ups (which
        make the derived tensors): normal tensors, gradients off; inside inference mode only
        where the buffers the forward writes are inference tensors."""
        if self.inference is None:
            return _normal_tensors(self.buffers)
        return inference_graph_modes(self.inference and any(t.is_inference()
                                                            for t in self.buffers))

    def _capturing_mode(self) -> contextlib.AbstractContextManager:
        """The modes of a capture: the specialization's (see ``inference``)."""
        if self.inference is None:
            return contextlib.nullcontext()
        return inference_graph_modes(self.inference)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The main graph (reading the static input buffers)."""
        return self.main.graph if self.main is not None else None

    @property
    def static_outputs(self) -> Any:
        """The main graph's output buffers."""
        return self.main.outputs if self.main is not None else None

    def _capture(self) -> None:
        fn = self.fn
        self._drop_extra_graphs()  # a recapture drops the spare and direct graphs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with COMPILE_LOCK, restored(self.buffers):  # warm-ups leave no update behind
            with torch.cuda.stream(side), self._scope(), self._making():
                for _ in range(self.warmup):  # the first call records what the forward derives
                    fn(*self.static_inputs)
                if self.derivations is not None:
                    self.derivations.build()
                    self.derivations.prologue()  # its first run derives everything
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with capturing(graph, self._turns, stream=self.stream), self._scope(), \
                        self._capturing_mode():
                    outputs = self._forward(self.static_inputs)
            except Exception as exc:  # cudaErrorStreamCapture*, or the forward's own error
                self.close()
                raise CaptureError(condense(f"{type(exc).__name__}: {exc}", limit=300)) from exc
        self.main = CapturedForward(graph, outputs, self.static_inputs, self.stream,
                                    self.state)

    def _forward(self, args: Sequence[Any]) -> Any:
        """What a graph holds: the derivation prologue, then the forward (which waits for the
        prologue's side stream where it first reads what it derives, and at its end)."""
        if self.derivations is None:
            return self.fn(*args)
        self.derivations.prologue()
        try:
            return self.fn(*args)
        finally:
            self.derivations.finish()

    def _try_capture(self, args: Sequence[Any], pool: Any) -> CapturedForward | bool | None:
        """A further capture of the forward on ``args`` (in ``pool``, ``None``: a pool of its
        own); ``None`` when it cannot be made now (a background compile holds
        :data:`~.background.COMPILE_LOCK`: beside one, captures failed; a later call tries again),
        ``False`` when capture failed (no later call tries)."""
        if not COMPILE_LOCK.acquire(blocking=False):
            return None
        graph = torch.cuda.CUDAGraph()
        try:
            with capturing(graph, self._turns, pool, self.stream), self._scope(), \
                    self._capturing_mode():
                outputs = self._forward(args)
            return CapturedForward(graph, outputs, args, self.stream, self.state)
        except Exception as exc:  # noqa: BLE001 - the calls go on without this graph
            warn_once("capturing a further CUDA graph (the direct or the spare one)",
                      condense(f"{type(exc).__name__}: {exc}", limit=200) + "; the calls it "
                      "would serve copy their inputs into the main graph, or run without one")
            return False
        finally:
            COMPILE_LOCK.release()

    def _scope(self) -> contextlib.AbstractContextManager:
        """The derivations' scope; without them, an epoch whose values the graph recomputes at
        every replay (kept as long as the runner)."""
        if self.derivations is not None:
            return derivation_scope(self.derivations)
        self._epochs.append(Epoch())
        return derivation_scope(self._epochs[-1])

    @staticmethod
    def _key(args: Sequence[Any]) -> tuple:
        """Where the tensor arguments are: (address, strides) each."""
        return tuple((a.data_ptr(), a.stride()) if isinstance(a, torch.Tensor) else None
                     for a in args)

    def __call__(self, *args: Any) -> Any:
        if torch.cuda.is_current_stream_capturing():  # the caller's own capture: no replay
            # there; the forward (prologue included) joins its graph, after this runner's own
            # captures and calls (the derivations' host state is the runner's)
            with self._turns.lock, self._scope():
                return self._forward(args)
        with self._turns.turn():
            return self._call(args)

    def _call(self, args: Sequence[Any]) -> Any:
        key = self._key(args)
        if key == self._last_key:  # the caller refilled its tensors
            # (outside inference mode not over inference tensors it writes: eager refuses too)
            if self._direct is None and (self.inference or not any(
                    args[i].is_inference() for i in self.written)):
                self._direct, self._direct_key = self._try_capture(args, None), key
            direct = self._direct
            if direct and key == self._direct_key and not direct.held() and direct.fits(args):
                return direct.replay("safe", args)
        self._last_key = key
        if not self.main.fits(args):  # an output is a view of an input laid out otherwise
            return self._eager(args)
        for static, a in zip(self.static_inputs, args):
            if isinstance(static, torch.Tensor):
                static.copy_(a)
        if not self.main.held():
            return self._written_back(args, self.main.replay("safe", args))
        # a buffer handed out (or a view of one) is still held: the spare graph, whose outputs
        # never leave the runner
        if self._spare is None:
            self._spare = self._try_capture(self.static_inputs, self.main.graph.pool())
        if not self._spare:
            return self._eager(args)
        return self._written_back(args, self._spare.replay("copies", args))

    def _eager(self, args: Sequence[Any]) -> Any:
        """The forward run eagerly on ``args``, the derived values (hoisted ones) brought up to
        date first."""
        if self.derivations is not None:
            self.derivations.prologue()  # (not capturing: its programs in turn, here)
        return self.fn(*args)

    def _written_back(self, args: Sequence[Any], outputs: Any) -> Any:
        """``outputs``, after copying what the replay wrote into input buffers to the caller's
        inputs (eager writes into them)."""
        for i in self.written:
            args[i].copy_(self.static_inputs[i])
        return outputs

    def settle(self) -> None:
        """Make the current stream wait for the work of this runner's last call, whichever
        stream it ran on: a runner built next over the same hoisted tensors (the tier switch)
        writes them, and must not overtake a replay still reading them."""
        with self._turns.closing():
            pass

    def _drop_extra_graphs(self) -> None:
        for extra in (self._spare, self._direct):
            if extra:
                extra.reset()
        self._spare = self._direct = None
        self._direct_key = self._last_key = None

    def close(self) -> None:
        """Free the graphs, their memory pools and the static buffers (the runner is unusable
        after; a call running on another thread ends first, and the current stream waits for the
        last call's)."""
        with self._turns.closing():
            self._drop_extra_graphs()
            if self.main is not None:
                self.main.reset()
            self.main = None
            self.static_inputs = []
            self._epochs = []
