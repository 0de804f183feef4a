"""Autotuning: the timing that selects among a cuDNN graph's ranked execution plans.

cuDNN's heuristics rank the engines that can run a graph, but their first choice is often not the
fastest: on an H100 (cuDNN 9.19, fp16) the first plan of a 512->512 3x3 conv + add + ReLU at
N=128, 2x2 took 23.7 us and the fifth 12.8 us. The frontend exposes the ranked list
(``get_execution_plan_count``, ``build_plan_at_index``: cuDNN frontend docs, "Autotuning");
:class:`~.cudnn_plan.CudnnPlan` builds the first ``autotune`` of them (in worker processes,
:mod:`.plan_workers`), times each with :func:`gpu_time_ms` (CUDA graph replays timed with CUDA
events) on random data of the graph's own shapes, strides and dtypes (:func:`sample_pack`), and
keeps the fastest.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ...ir.ops import node_device
from ...ir.errors import TimingDeferred
from ...runtime.tiered import COMPILE_LOCK, ThreadFlag

__all__ = ["PlanTiming", "fastest", "sample_pack", "sample_tensor", "sample_inputs", "gpu_time_ms",
           "paired_time_ms", "PYTORCH_MARGIN", "timing_deferred", "ensure_timing_allowed"]

PYTORCH_MARGIN = 0.9
"""PyTorch's ops replace a region's forward cuDNN graph only when they time below this fraction of
it (10% faster): near-ties would otherwise flip between runs on timing noise. Gradient graphs do
not use it (:mod:`.cudnn_backward`): they are kept only when not slower."""


_DEFERRED = ThreadFlag()


@contextlib.contextmanager
def timing_deferred():
    """Within it, on this thread, any GPU timing of this module raises
    :class:`~fusion_compiler.errors.TimingDeferred` (:func:`ensure_timing_allowed`): for work
    done beside a caller's GPU work, where timings would be noise (tier 0's background lowering,
    :meth:`fusion_compiler.compiler.CompiledModule._tier_before_lowering`)."""
    with _DEFERRED.raised():
        yield


def ensure_timing_allowed(what: str = "GPU timing") -> None:
    """Raises:
        TimingDeferred: inside :func:`timing_deferred` on this thread."""
    if _DEFERRED:
        raise TimingDeferred(f"{what} deferred: this thread runs beside the caller's GPU work")


@dataclass
class PlanTiming:
    """One ranked plan as autotuning saw it: ``ms`` per execution (median), or why it was skipped.

    ``build_s`` is the wall time of ``build_plan_at_index`` (seconds): runtime-compiled engines
    pay 0.5-3 s here, precompiled ones milliseconds.
    """

    index: int
    name: str
    ms: float | None
    build_s: float
    workspace_bytes: int = 0
    reason: str = ""


def fastest(timings: list[PlanTiming]) -> PlanTiming | None:
    """The timed plan with the lowest ``ms``; ``None`` when no plan ran."""
    return min((t for t in timings if t.ms is not None), key=lambda t: t.ms, default=None)


_TORCH_DTYPE = {"HALF": torch.float16, "BFLOAT16": torch.bfloat16, "FLOAT": torch.float32}


def _random(shape, strides, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values ~ N(0, 0.5²) (finite through a few pointwise ops) laid out with ``strides``."""
    size = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    return (torch.randn(size, dtype=dtype, device=device) * 0.5).as_strided(shape, strides)


def sample_pack(tensors: dict[int, Any], device: torch.device) -> dict[int, torch.Tensor]:
    """Random device tensors for graph tensors ``{uid: cudnn tensor}``, with their dims, strides
    and dtypes."""
    return {uid: _random(list(t.get_dim()), list(t.get_stride()),
                         _TORCH_DTYPE[str(t.get_data_type()).rsplit(".", 1)[-1]], device)
            for uid, t in tensors.items()}


def sample_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  strides: Sequence[int] | None = None) -> torch.Tensor:
    """A random tensor of ``shape`` (see :func:`_random` for the values) laid out with
    ``strides``; by default channels_last when 4-d: the layout activations have between cuDNN
    regions at run time."""
    if strides is None:
        strides = torch.empty(tuple(shape), device="meta").contiguous(
            memory_format=torch.channels_last if len(shape) == 4 else torch.contiguous_format
        ).stride()
    return _random(tuple(shape), tuple(strides), dtype, device)


def sample_inputs(region) -> list[torch.Tensor]:
    """Random tensors like ``region``'s inputs (shapes, dtypes, device from the placeholders'
    ``meta["val"]``), made by :func:`sample_tensor`: 4-d tensors are channels_last, as activations
    arrive from an upstream cuDNN region at run time (the captured strides are eager's NCHW ones)."""
    return [sample_tensor(ph.meta["val"].shape, ph.meta["val"].dtype, node_device(ph))
            for ph in region.graph_module.graph.find_nodes(op="placeholder")]


def gpu_time_ms(run: Callable[[], object], reps: int = 3, iters: int = 10) -> float:
    """GPU time of one ``run()`` in ms: the median over ``reps`` replays of a CUDA graph holding
    ``iters`` back-to-back calls. A CUDA graph, because timing calls issued from Python would
    measure the host (about 20 us per ``execute``, CUDNN_FACTS.md) rather than the kernel."""
    return paired_time_ms([run], reps, iters)[0]


def _captured(run: Callable[[], object], iters: int, stream: torch.cuda.Stream
              ) -> torch.cuda.CUDAGraph:
    """``iters`` calls of ``run`` captured on ``stream`` in a CUDA graph. Captured by hand:
    ``torch.cuda.graph`` also runs ``gc.collect()`` and ``empty_cache()`` on entry, which cost
    tens of ms per graph in a compiling process and autotuning captures about a hundred."""
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with COMPILE_LOCK, torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(iters):
                run()
        finally:
            graph.capture_end()
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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for run in runs:
            run()  # warm-up outside capture: first launch loads the kernel
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for run in runs:
        graphs.append(_captured(run, iters, stream))
        graphs[-1].replay()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for graph, times in zip(graphs, samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
    return [statistics.median(times) for times in samples]
