"""Profiling for the benchmark: GPU operations per call, the kernels of a few calls by name and
by category (convolutions, dgrad, wgrad, Triton glue, GEMMs, copies), as ``torch.profiler`` sees
them. Look at one replay's kernels before trusting a CUDA-graph time."""

from __future__ import annotations

import re
from typing import Callable, Sequence

import torch

__all__ = ["gpu_ops_per_call", "KERNEL_CATEGORIES", "kernel_category", "kernel_categories",
           "kernel_profile"]


def gpu_ops_per_call(fn: Callable[[], object], calls: int = 5) -> float:
    """GPU operations (kernels, copies and fills) per call of ``fn``, counted by
    ``torch.profiler`` over ``calls`` calls: what a CUDA-graph replay launches."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(device_events) / calls


KERNEL_CATEGORIES = (
    ("conv dgrad", r"dgrad"),
    ("conv wgrad", r"wgrad"),
    ("conv forward", r"convFwd|fprop|implicit_gemm|conv2d|convolution"),
    ("triton glue", r"^triton_"),
    ("gemm", r"gemm|nvjet|cutlass|cublas"),
    ("copies", r"^Memcpy|^Memset|copy"),
    ("other", r""),
)
"""Kernel categories of :func:`kernel_categories`: (name, regular expression searched in the
kernel's name), the first match wins. cuDNN and PyTorch convolution kernels on sm90 are named
``cudnn_generated_fort_native_sm90_convFwd...`` (fused forward graphs) and
``sm90_xmma_{fprop,dgrad,wgrad}_implicit_gemm...`` (as profiled on an H100 with cuDNN 9.19)."""


def kernel_category(name: str) -> str:
    """The :data:`KERNEL_CATEGORIES` name of a kernel called ``name``."""
    return next(cat for cat, pattern in KERNEL_CATEGORIES if re.search(pattern, name))


def kernel_categories(kernels: Sequence[tuple[str, float]], calls: int) -> dict[str, dict]:
    """Per category, GPU time (ms) and kernel count per call, from ``(kernel name, microseconds)``
    pairs recorded over ``calls`` calls, and its slowest kernel (``"slowest"``: name and mean
    microseconds per launch); ``"total"`` sums the times and counts. The slowest kernel is worth
    a look when a variant's time moves between runs: one Triton reduction of SE-ResNet9's glue
    took several times longer in some compiles than in others (measurements: docs/decisions.md,
    "The custom-op aliasing check put off for Inductor's first call")."""
    launches: dict[str, list[float]] = {}
    for name, us in kernels:
        launches.setdefault(name, []).append(us)
    out: dict[str, dict] = {}
    for name, times in launches.items():
        cat = out.setdefault(kernel_category(name), {"ms": 0.0, "kernels": 0.0})
        cat["ms"] += sum(times) / 1e3 / calls
        cat["kernels"] += len(times) / calls
        mean = sum(times) / len(times)
        if "slowest" not in cat or mean > cat["slowest"][1]:
            cat["slowest"] = [name, mean]
    out["total"] = {"ms": sum(c["ms"] for c in out.values()),
                    "kernels": sum(c["kernels"] for c in out.values())}
    return out


def kernel_profile(fn: Callable[[], object], calls: int = 20) -> tuple[str, dict[str, dict]]:
    """Kernel names, counts and CUDA time of ``calls`` calls (``torch.profiler``), as a table, and
    the time per call by category (:func:`kernel_categories`)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [(e.name, e.device_time) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    return table, kernel_categories(kernels, calls)
