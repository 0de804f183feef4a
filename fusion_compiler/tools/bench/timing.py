"""Timing for the benchmark: CUDA-event medians of back-to-back calls, a step captured in a CUDA
graph, the training step the benchmark times, the fp32 reference's true-fp32 context."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from ..check import floating_outputs

__all__ = ["device_name", "time_ms", "graphed", "train_step", "fp32_convolutions", "sync",
           "mixed_precision"]


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` on CUDA, else the CPU's name and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device | str, reps: int = 15,
            iters: int | None = None) -> dict:
    """Time ``fn``: ``{"median", "q1", "q3"`` (ms per call) ``, "iters", "reps"}`` (see module
    doc: 3 warm-up calls, then ``reps`` timings of ``iters`` calls each; ``iters=None`` takes what
    fills 20 ms, at least 1)."""
    device = torch.device(device)
    for _ in range(3):
        fn()
    sync(device)
    if iters is None:
        t0 = time.perf_counter()
        fn()
        sync(device)
        iters = max(1, min(1000, int(0.02 / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    q1, median, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return {"median": median, "q1": q1, "q3": q3, "iters": iters, "reps": reps}


def graphed(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` (static inputs: it takes none) warmed up 3 times on a side stream and captured
    in one CUDA graph (:class:`~fusion_compiler.runtime.cuda_graph.CudaGraphRunner`); calling the
    result replays it and returns the graph's outputs (its own buffers while nothing holds the
    last ones)."""
    from ...runtime.cuda_graph import CudaGraphRunner  # noqa: PLC0415

    return CudaGraphRunner(step, [], warmup=3)


def mixed_precision(device: torch.device, amp: bool) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to fp16 on CUDA (bf16 elsewhere) with ``amp``, else nothing."""
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, torch.float16 if device.type == "cuda" else torch.bfloat16)


def train_step(model: torch.nn.Module, run: Callable[..., Any], inputs: Sequence[Any],
               mark: bool = False, amp: bool = False) -> Callable[[], None]:
    """One forward and backward of ``run`` (the model or a compiled form of it): gradients of
    every parameter set to ``None``, loss = sum over outputs of mean(out**2) in fp32. With
    ``amp`` (the recipe of PyTorch's automatic mixed precision examples, fp32 parameters) the
    forward runs under :func:`mixed_precision`, the loss is scaled by a
    ``torch.amp.GradScaler`` and each step ends with the scaler's step of an SGD optimizer
    (learning rate 1e-4) and its update."""
    device = next(model.parameters()).device
    if amp:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type)

    def step() -> None:
        if mark:  # a new step for CUDA graph trees: earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        with mixed_precision(device, amp):
            loss = sum(o.float().square().mean() for o in floating_outputs(run(*inputs)))
        if not amp:
            loss.backward()
            return
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return step


@contextlib.contextmanager
def fp32_convolutions():
    """True fp32 convolutions and matmuls for the reference (TF32 off)."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
