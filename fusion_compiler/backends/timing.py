"""Timing on the GPU, shared by the backends: random inputs of a region's shapes, CUDA-graph
timings of one implementation or several in turn, and the switch that forbids timing on a thread
that runs beside a caller's GPU work."""

from __future__ import annotations

import contextlib
import statistics
from typing import Callable, Sequence

import torch

from ..ir.errors import TimingDeferred
from ..ir.ops import node_device
from ..ir.region import channel_view_total
from ..runtime.replays import GraphTurn, capture_turn, release_rng_capture
from ..runtime.tensors import channel_view_strides, ready_to_capture, side_stream
from ..runtime.background import COMPILE_LOCK, ThreadFlag, gc_paused
from ..runtime.weight_cache import derivation_epoch

__all__ = ["PYTORCH_MARGIN", "timing_deferred", "ensure_timing_allowed", "random_tensor",
           "sample_tensor", "sample_inputs", "gpu_time_ms", "paired_time_ms"]

PYTORCH_MARGIN = 0.9
"""PyTorch's ops replace a region's forward cuDNN graph only when they time below this fraction of
it (10% faster): near-ties would otherwise flip between runs on timing noise. Gradient graphs do
not use it (:mod:`.cudnn.backward`): they are kept only when not slower."""


_DEFERRED = ThreadFlag()


@contextlib.contextmanager
def timing_deferred():
    """Within it, on this thread, any GPU timing of this module raises
    :class:`~fusion_compiler.ir.errors.TimingDeferred` (:func:`ensure_timing_allowed`): for work
    done beside a caller's GPU work, where timings would be noise (tier 0's background lowering,
    :meth:`fusion_compiler.specialization.SpecializationCompiler._tier_before_lowering`)."""
    with _DEFERRED.raised():
        yield


def ensure_timing_allowed(what: str = "GPU timing") -> None:
    """Raises:
        TimingDeferred: inside :func:`timing_deferred` on this thread."""
    if _DEFERRED:
        raise TimingDeferred(f"{what} deferred: this thread runs beside the caller's GPU work")


def random_tensor(shape, strides, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values ~ N(0, 0.5²) (finite through a few pointwise ops) laid out with ``strides``; a
    normal tensor even under ``torch.inference_mode`` (an inference tensor has no version
    counter, so what kernels cache per weight version would be made again at every timed
    call). Drawn from a generator of its own, seeded the same each time: the process's default
    generator is the user's, and a compile that drew from it (on any thread) would change the
    random numbers the user's program draws next (its dropout masks, a parametrization's
    initial vectors) from what the uncompiled program draws."""
    size = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode(False):
        values = torch.randn(size, dtype=dtype, device=device, generator=generator)
        return (values * 0.5).as_strided(shape, strides)


def sample_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  strides: Sequence[int] | None = None) -> torch.Tensor:
    """A random tensor of ``shape`` (see :func:`random_tensor` for the values) laid out with
    ``strides``; by default channels_last when 4-d: the layout activations have between cuDNN
    regions at run time."""
    if strides is None:
        strides = torch.empty(tuple(shape), device="meta").contiguous(
            memory_format=torch.channels_last if len(shape) == 4 else torch.contiguous_format
        ).stride()
    return random_tensor(tuple(shape), tuple(strides), dtype, device)


def sample_inputs(region) -> list[torch.Tensor]:
    """Random tensors like ``region``'s inputs (shapes, dtypes, device from the placeholders'
    ``meta["val"]``), made by :func:`sample_tensor`: 4-d tensors are channels_last, as activations
    arrive from an upstream cuDNN region at run time (the captured strides are eager's NCHW
    ones), and a channel view of a wider tensor is laid out as one."""
    return [sample_tensor(ph.meta["val"].shape, ph.meta["val"].dtype, node_device(ph),
                          _view_strides(ph))
            for ph in region.graph_module.graph.find_nodes(op="placeholder")]


def _view_strides(ph) -> tuple[int, ...] | None:
    """A channel view's strides (it arrives so: a horizontally fused convolution's output), or
    ``None`` for the default layout."""
    total = channel_view_total(ph)
    return None if total is None else channel_view_strides(ph.meta["val"].shape, total)


def gpu_time_ms(run: Callable[[], object], reps: int = 3, iters: int = 10) -> float:
    """GPU time of one ``run()`` in ms: the median over ``reps`` replays of a CUDA graph holding
    ``iters`` back-to-back calls. A CUDA graph, because timing calls issued from Python would
    measure the host's cost of each ``execute`` rather than the kernel (measurements:
    docs/decisions.md, "Regions timed against PyTorch ops with a 10% margin")."""
    return paired_time_ms([run], reps, iters)[0]


def _captured(run: Callable[[], object], iters: int, stream: torch.cuda.Stream
              ) -> torch.cuda.CUDAGraph:
    """``iters`` calls of ``run`` captured on ``stream`` in a CUDA graph. Captured by hand:
    ``torch.cuda.graph`` also runs ``gc.collect()`` and ``empty_cache()`` on entry, which are
    slow in a compiling process, and autotuning captures about a hundred graphs (measurements:
    docs/decisions.md, "Regions timed against PyTorch ops with a 10% margin"). Called within the
    :func:`~fusion_compiler.runtime.weight_cache.derivation_epoch` of the warm-up call: what a
    kernel derives from its weight (a channels_last or dense copy) is read by the graph, as in
    the graphs that run (whose derivation prologue rewrites it only when the weight changes), not
    timed."""
    graph = torch.cuda.CUDAGraph()
    ready_to_capture(stream.device.index)  # the thread's library handles, made outside
    stream.wait_stream(torch.cuda.current_stream())
    try:  # the device's replays wait while it captures (its prologue fills the RNG offset)
        with COMPILE_LOCK, gc_paused(), capture_turn(stream), torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(iters):
                    run()
            finally:
                graph.capture_end()
    except BaseException:
        release_rng_capture(stream.device.index)  # a failed capture leaves the generator stuck
        raise
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def paired_time_ms(runs: Sequence[Callable[[], object]], reps: int = 3, iters: int = 10
                   ) -> list[float]:
    """GPU time of one call of each of ``runs`` in ms, as :func:`gpu_time_ms` takes it, with the
    CUDA-graph replays of the runs alternating (``a b a b ...``) so that clock or thermal drift
    during the measurement affects all of them alike: the fair way to compare two
    implementations of the same work.

    Raises:
        TimingDeferred: inside :func:`timing_deferred`.
    """
    ensure_timing_allowed()
    stream = side_stream("timing")  # one cuDNN workspace serves it (:mod:`.cudnn.resources`)
    stream.wait_stream(torch.cuda.current_stream())
    with derivation_epoch() as epoch:  # held until the graphs are timed
        with torch.cuda.stream(stream):
            for run in runs:
                run()  # warm-up outside capture: first launch loads the kernel
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for run in runs:  # in turn with other graphs' replays (runtime.replays)
            graphs.append((_captured(run, iters, stream), GraphTurn(stream)))
            with graphs[-1][1].replaying():
                graphs[-1][0].replay()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for (graph, turn), times in zip(graphs, samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with turn.replaying():  # its waits queued before the start
                start.record()
                graph.replay()
                end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
    del epoch
    return [statistics.median(times) for times in samples]
