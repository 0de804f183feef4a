"""``fusion-compiler bench``: a model timed in eager PyTorch, ``torch.compile`` and fusion_compiler,
side by side in one process.

Inference times one forward; training (``train=True``) one forward, loss (mean of squares of every
output, in fp32) and backward, the gradients set to ``None`` first and no optimizer step (so the
figures are the model's, not an optimizer's). Variants:

==================================  ================================================================
``eager``                           the model itself
``eager+cudagraph``                 the same call captured in one CUDA graph and replayed
                                    (``torch.cuda.CUDAGraph``, static inputs)
``torch.compile``                   ``torch.compile(model)`` (Inductor, default mode)
``torch.compile reduce-overhead``   ``torch.compile(model, mode="reduce-overhead")`` (CUDA graph
                                    trees; training steps marked with
                                    ``torch.compiler.cudagraph_mark_step_begin``)
``fusion_compiler``                 ``fusion_compiler.compile(model)`` with its defaults, and any
                                    other ``fusion_variants`` (label -> ``compile`` options)
``fusion_compiler+cudagraph``       training only: the step of the first ``fusion_variants`` entry,
                                    compiled with ``cuda_graph=False``, captured in one CUDA graph
                                    by hand (README, "Training")
==================================  ================================================================

Timing (the method of shared/BASELINES.md): after 3 warm-up calls, ``reps`` repetitions of
``iters`` back-to-back calls, each repetition timed with CUDA events (``time.perf_counter`` on the
CPU); ms per call is the median over repetitions, the spread their quartiles. ``iters`` defaults
to what fills 20 ms. "compile s" is the variant's build plus first call in this process; "cold" and
"warm" compile times are seconds to the first output in new processes
(:mod:`fusion_compiler.first_output`) with empty cache directories and with the ones the cold run
filled. For inference each variant's output is also compared with an fp32 copy of the model (TF32
off), beside eager's error.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import unittest.mock
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..check import floating_outputs, relative_error

__all__ = ["bench", "BenchRecipe", "INFERENCE_VARIANTS", "TRAIN_VARIANTS", "ALTERNATING",
           "KERNEL_CATEGORIES", "kernel_categories", "kernel_category", "kernel_profile", "time_ms",
           "format_results", "plot", "device_name", "add_arguments", "write"]

INFERENCE_VARIANTS = ("eager", "eager+cudagraph", "torch.compile", "torch.compile reduce-overhead",
                      "fusion_compiler")
TRAIN_VARIANTS = (*INFERENCE_VARIANTS, "fusion_compiler+cudagraph")
_NEEDS_CUDA = {"eager+cudagraph", "torch.compile reduce-overhead", "fusion_compiler+cudagraph"}
ALTERNATING = "fusion_compiler 2 inputs alternating"
"""The first fusion_compiler variant called with two input tensors in turn: each call passes
another tensor than the last, so its CUDA graph copies the input in (the other rows pass one
tensor every call, which a graph then reads in place: ``runtime/cuda_graph.py``)."""


@dataclass(frozen=True)
class BenchRecipe:
    """How to rebuild the model and its inputs in a new process (for cold and warm compile
    times): ``model_ref`` (``module:factory``), input ``shapes``, ``dtype`` name, ``device``,
    whether parameters are channels_last."""

    model_ref: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    device: str
    channels_last: bool = False


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` on CUDA, else the CPU's name and core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _sync(device: torch.device) -> None:
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
    _sync(device)
    if iters is None:
        t0 = time.perf_counter()
        fn()
        _sync(device)
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


def _graphed(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` (static inputs: it takes none) warmed up 3 times on a side stream and captured
    in one CUDA graph (:class:`~fusion_compiler.runtime.cuda_graph.CudaGraphRunner`); calling the
    result replays it and returns the graph's own outputs."""
    from ...runtime.cuda_graph import CudaGraphRunner  # noqa: PLC0415

    return CudaGraphRunner(step, [], warmup=3, copy_outputs=False)


def _train_step(model: torch.nn.Module, run: Callable[..., Any], inputs: Sequence[Any],
                mark: bool = False) -> Callable[[], None]:
    """One forward and backward of ``run`` (the model or a compiled form of it): gradients of
    every parameter set to ``None``, loss = sum over outputs of mean(out**2) in fp32."""
    def step() -> None:
        if mark:  # a new step for CUDA graph trees: earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        sum(o.float().square().mean() for o in floating_outputs(run(*inputs))).backward()
    return step


def _makers(model: torch.nn.Module, inputs: Sequence[Any], train: bool,
            fusion_variants: dict[str, dict], cache_dir: str, result: dict
            ) -> dict[str, Callable[[], Callable[[], object]]]:
    """Per variant, a function that builds it and returns the callable to time."""
    import fusion_compiler as fc  # noqa: PLC0415
    from ..report import format_gradients, format_tuning, summarize  # noqa: PLC0415

    def fresh() -> torch.nn.Module:  # training variants each get their own parameters
        return copy.deepcopy(model) if train else model

    first = next(iter(fusion_variants))  # the variant whose choices and tables are reported

    def ours(label: str, graph_whole_step: bool = False,
             alternate: bool = False) -> Callable[[], object]:
        options = fusion_variants[label]
        if graph_whole_step:  # the step is captured by hand: no graph inside it
            options = {**options, "cuda_graph": False}
        m = fresh()
        module = fc.compile(m, cache_dir=cache_dir, progress=False, **options)  # spinner instead
        if not train:
            spec = module.specialize(*inputs)
            if label == first:  # what compile(model) chose, per region
                summary = summarize(spec)
                result["fusion_compiler"] = {"cuda_graph": spec.cuda_graph,
                                             "glue": spec.glue_backend, "notes": spec.notes,
                                             "regions": summary["regions_per_backend"],
                                             "conv_gflop": summary["conv_gflop"]}
                result["tuning"] = format_tuning(spec.regions)
            module(*inputs)  # the first output, then the steady state: the compiled glue
            module.wait_for_background_compiles()
            if alternate:
                turns = itertools.cycle((inputs, [t.clone() if isinstance(t, torch.Tensor)
                                                  else t for t in inputs]))
                return lambda: module(*next(turns))
            return lambda: module(*inputs)
        step = _train_step(m, module, inputs)
        step()
        if label == first:
            result["gradients"] = format_gradients(module.last.regions)
        return _graphed(step) if graph_whole_step else step

    def plain(run_of: Callable[[torch.nn.Module], Callable], graph: bool = False,
              mark: bool = False) -> Callable[[], object]:
        m = fresh()
        run = run_of(m)
        fn = _train_step(m, run, inputs, mark) if train else (lambda: run(*inputs))
        return _graphed(fn) if graph else fn

    makers = {
        "eager": lambda: plain(lambda m: m),
        "eager+cudagraph": lambda: plain(lambda m: m, graph=True),
        "torch.compile": lambda: plain(torch.compile),
        "torch.compile reduce-overhead": lambda: plain(
            lambda m: torch.compile(m, mode="reduce-overhead"), mark=train),
        "fusion_compiler+cudagraph": lambda: ours(first, graph_whole_step=True),
    }
    for label in fusion_variants:
        makers[label] = lambda lab=label: ours(lab)
    if not train:
        makers[ALTERNATING] = lambda: ours(first, alternate=True)
    return makers


@contextlib.contextmanager
def _status(console: Any, text: str):
    if console is None:
        yield
        return
    with console.status(text):
        yield


def bench(model: torch.nn.Module, inputs: Sequence[Any], *, train: bool = False,
          variants: Sequence[str] | None = None, fusion_variants: dict[str, dict] | None = None,
          reps: int | None = None, iters: int | None = None, recipe: BenchRecipe | None = None,
          profile: bool = False, compile_labels: Sequence[str] | None = None,
          progress: bool = True) -> dict:
    """Time ``model`` on ``inputs`` in every variant (module doc) and return a JSON-ready result.

    Args:
        model: on its device, in its dtype and mode (not changed for inference; training variants
            each train a copy).
        inputs: the example inputs, used by every call.
        variants: which to run (default: all for the mode that run on the device; the variants
            that need CUDA are skipped on the CPU with that reason).
        fusion_variants: label -> :func:`fusion_compiler.compile` options, each timed as a
            variant of its own (default ``{"fusion_compiler": {}}``: the defaults).
        reps, iters: see :func:`time_ms` (``reps`` default 15 on CUDA, 5 on the CPU).
        recipe: rebuild instructions for cold and warm compile times in new processes
            (inference only); ``None`` skips them.
        profile: keep a kernel table (``torch.profiler``, 20 calls) of the fusion_compiler defaults
            and of reduce-overhead (CUDA only: check the replays hold the expected kernels).
        compile_labels: the fusion_compiler variants whose cold and warm compile times (with
            ``recipe``) and first call at half the batch (inference) are measured (default: the
            first of ``fusion_variants``).
        progress: spinner and one line per variant on stderr.

    Returns:
        ``{"model", "inputs", "dtype", "device", "gpu", "torch", "train", "ms": {variant: time_ms
        dict or None}, "compile_s": {...}, "rel_err_vs_fp32": {...}, "skipped": {variant: reason},
        "errors": {variant: message}, "profiles": {variant: table}, "kernel_time": {variant:
        :func:`kernel_categories`} (with ``profile``), "gpu_ops": {variant: GPU
        operations per call} (CUDA), "first"`` (the label of the first fusion variant) ``}``,
        and the keys below. A variant that fails is
        reported in ``errors`` and the others go on.
    """
    from rich.console import Console  # noqa: PLC0415

    console = Console(stderr=True) if progress else None
    first = next(t for t in inputs if isinstance(t, torch.Tensor))
    device = first.device
    fusion_variants = fusion_variants or {"fusion_compiler": {}}
    names = list(variants) if variants is not None else [
        *(v for v in (TRAIN_VARIANTS if train else INFERENCE_VARIANTS) if v != "fusion_compiler"),
        *fusion_variants, *(() if train else (ALTERNATING,))]
    result: dict = {"model": type(model).__name__, "inputs": [list(t.shape) for t in inputs],
                    "dtype": str(first.dtype).removeprefix("torch."), "device": str(device),
                    "gpu": device_name(device), "torch": torch.__version__, "train": train,
                    "ms": {}, "compile_s": {}, "skipped": {}, "errors": {},
                    "first": next(iter(fusion_variants))}
    reps = reps or (15 if device.type == "cuda" else 5)
    cache_dir = tempfile.mkdtemp(prefix="fc-bench-plans-")
    makers = _makers(model, inputs, train, fusion_variants, cache_dir, result)
    unknown = [v for v in names if v not in makers]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(makers)}")
    reference = None
    if not train:
        with torch.inference_mode(), _fp32_convolutions():
            reference = floating_outputs(copy.deepcopy(model).float()(*[
                t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in inputs]))
        result["rel_err_vs_fp32"] = {}
    first_fusion = result["first"]
    built: dict[str, Callable[[], object]] = {}  # kept for the profiler, after all timings
    grad = torch.enable_grad() if train else torch.inference_mode()
    with grad:
        for name in names:
            if name in _NEEDS_CUDA and device.type != "cuda":
                result["skipped"][name] = "needs CUDA"
                continue
            try:
                with _status(console, f"bench: building {name}"):
                    t0 = time.perf_counter()
                    fn = makers[name]()
                    fn()
                    _sync(device)
                    result["compile_s"][name] = time.perf_counter() - t0
                with _status(console, f"bench: timing {name}"):
                    result["ms"][name] = time_ms(fn, device, reps, iters)
                if reference is not None:
                    out = floating_outputs(fn())
                    result["rel_err_vs_fp32"][name] = max(
                        relative_error(o, r) for o, r in zip(out, reference)) if out else None
                    # not held into the profile: a CUDA-graph runner whose last outputs are still
                    # held replays its copying graph (an input copy per call: 27 us in depth)
                    del out
                built[name] = fn
            except Exception as exc:  # one broken variant must not hide the others
                result["ms"][name] = None
                result["errors"][name] = " ".join(str(exc).split())[:300]
            if console is not None:
                ms = result["ms"].get(name)
                console.log(f"{name}: " + (f"{ms['median']:.3f} ms, compiled in "
                                           f"{result['compile_s'][name]:.1f} s" if ms else
                                           f"failed: {result['errors'][name]}"))
        # The profiler runs after all timings, so no variant is timed after a profiler session
        # and another not (whether one changes later host-side launch cost was not settled: one
        # probe on the H100 timed eager faster after it, within that machine's run-to-run spread)
        for name, fn in built.items() if device.type == "cuda" else ():
            try:
                result.setdefault("gpu_ops", {})[name] = gpu_ops_per_call(fn)
                if profile and name in (first_fusion, "torch.compile reduce-overhead",
                                        "fusion_compiler+cudagraph", "eager+cudagraph"):
                    table, split = kernel_profile(fn)
                    result.setdefault("profiles", {})[name] = table
                    result.setdefault("kernel_time", {})[name] = split
            except Exception as exc:  # reported, the rest goes on
                result["errors"][f"{name}, profile"] = " ".join(str(exc).split())[:300]
        built.clear()
        timed = {k: fusion_variants[k] for k in compile_labels or list(fusion_variants)[:1]}
        if not train and first.dim() > 0 and first.shape[0] >= 2:
            with _status(console, "bench: first call at half the batch"):
                _new_batch_seconds(model, inputs, timed, cache_dir, result)
    if recipe is not None and not train:
        with _status(console, "bench: compile times in new processes (cold and warm)"):
            result["compile_s"].update(new_process_compile_seconds(recipe, timed))
    return result


@contextlib.contextmanager
def _fp32_convolutions():
    """True fp32 convolutions and matmuls for the reference (TF32 off)."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old


def _new_batch_seconds(model: torch.nn.Module, inputs: Sequence[Any],
                       fusion_variants: dict[str, dict], cache_dir: str, result: dict) -> None:
    """Seconds of the first call at half the batch of a module compiled and called at the full
    one (same process, warm plan cache), and with tiering the seconds until that batch size runs
    its compiled glue (``"<label>, new batch, tiered up"``).

    The half batch's plans are built by a new plan-worker pool with an empty CUDA JIT cache
    (see :func:`new_process_compile_seconds`): what a batch size never seen on the machine
    costs, pool start included."""
    import fusion_compiler as fc  # noqa: PLC0415
    from ...backends.cudnn import workers as plan_workers  # noqa: PLC0415

    half = [t[: t.shape[0] // 2].clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    device = next(t for t in inputs if isinstance(t, torch.Tensor)).device
    for label, options in fusion_variants.items():
        plan_workers.shutdown()  # workers started from here on read the fresh CUDA_CACHE_PATH
        with tempfile.TemporaryDirectory(prefix="fc-new-batch-") as tmp, \
                unittest.mock.patch.dict(os.environ, CUDA_CACHE_PATH=os.path.join(tmp, "jit")):
            # a copy of the plan cache: plans another variant built at half the batch must not
            # be found there
            plans = shutil.copytree(cache_dir, os.path.join(tmp, "plans"))
            _new_batch_of(fc, label, options, model, inputs, half, device, plans, result)
    plan_workers.shutdown()  # no worker outlives the JIT cache directory it was started with


def _new_batch_of(fc: Any, label: str, options: dict, model: torch.nn.Module,
                  inputs: Sequence[Any], half: Sequence[Any], device: torch.device,
                  cache_dir: str, result: dict) -> None:
    """One variant of :func:`_new_batch_seconds`."""
    try:
        module = fc.compile(model, cache_dir=cache_dir, **options)
        module(*inputs)
        module.wait_for_background_compiles()
        _sync(device)
        t0 = time.perf_counter()
        module(*half)
        _sync(device)
        result["compile_s"][f"{label}, new batch"] = time.perf_counter() - t0
        if not module.wait_for_background_compiles(0):
            module.wait_for_background_compiles()
            result["compile_s"][f"{label}, new batch, tiered up"] = time.perf_counter() - t0
    except Exception as exc:  # reported, the rest goes on
        result["errors"][f"{label}, new batch"] = " ".join(str(exc).split())[:300]


def new_process_compile_seconds(recipe: BenchRecipe, fusion_variants: dict[str, dict]) -> dict:
    """Cold and warm seconds to the first output of each fusion_compiler variant and of
    reduce-overhead (CUDA only), each in a new process: cold with empty plan, Inductor and CUDA
    JIT cache directories, warm with the ones the cold run filled. A failure is reported as
    ``None`` with its message under ``"<label>, <run> error"``.

    The CUDA JIT cache (``CUDA_CACHE_PATH``, by default ``~/.nv/ComputeCache``) holds the
    driver's compiles of cuDNN's runtime-compiled kernels: on an H100, with it warm SE-ResNet9's
    96 candidate plans built in 4.3 s of worker time, and with it empty in 41 s (3.3 s and
    8.8 s to the end of the compile). Without a fresh one a "cold" run would measure whatever an
    earlier run on the machine left there."""
    script = Path(__file__).with_name("first_output.py")
    labels = dict(fusion_variants)
    if recipe.device.startswith("cuda"):
        labels["torch.compile reduce-overhead"] = None
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="fc-cold-") as tmp:
        for label, options in labels.items():
            plans, inductor, jit = (tempfile.mkdtemp(dir=tmp) for _ in range(3))
            env = {**os.environ, "FUSION_COMPILER_CACHE_DIR": plans,
                   "TORCHINDUCTOR_CACHE_DIR": inductor, "CUDA_CACHE_PATH": jit}
            variant = label if options is None else json.dumps(options)
            command = [sys.executable, str(script), recipe.model_ref, variant, recipe.dtype,
                       recipe.device, "1" if recipe.channels_last else "0",
                       *("x".join(map(str, s)) for s in recipe.shapes)]
            for run in ("cold", "warm"):
                proc = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                      env=env, cwd=os.getcwd())
                if proc.returncode == 0:  # seconds to the first output [, to the second tier]
                    first, *tiered = proc.stdout.strip().splitlines()[-1].split()
                    out[f"{label}, {run}"] = float(first)
                    if tiered:
                        out[f"{label}, {run}, tiered up"] = float(tiered[0])
                else:
                    out[f"{label}, {run}"] = None
                    out[f"{label}, {run} error"] = " ".join(proc.stderr.split())[-300:]
    return out


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
    a look when a variant's time moves between runs: on an H100 one Triton reduction of
    SE-ResNet9's glue took 3.5, 11.5 or 20.6 us, depending on the compile."""
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


def format_time_split(results: Sequence[dict]) -> str:
    """Where the time of each profiled variant goes, per call: GPU time by kernel category (ms,
    kernel count) and the gaps (median wall time less the kernels' time: launches, waits), or
    the overlap when the kernels' time is the larger (kernels on two streams at once,
    ``compile(concurrent_branches=True)``); then, a line each, every category's slowest kernel
    (mean us per launch)."""
    lines = []
    for r in results:
        for variant, cats in r.get("kernel_time", {}).items():
            t = r["ms"].get(variant)
            gap = None if t is None else t["median"] - cats["total"]["ms"]
            gaps = ("" if gap is None else f"; gaps {gap:.3f} ms" if gap >= 0
                    else f"; overlap {-gap:.3f} ms")
            parts = ", ".join(f"{name} {c['ms']:.3f} ({c['kernels']:.0f})"
                              for name, c in cats.items() if name != "total")
            lines.append(f"{_row_name(r)}: {variant}: kernels {cats['total']['ms']:.3f} ms in "
                         f"{cats['total']['kernels']:.0f}{gaps}: {parts}")
            lines += [f"    slowest {name}: {c['slowest'][0][:70]} {c['slowest'][1]:.1f} us"
                      for name, c in cats.items() if "slowest" in c]
    return "\n".join(lines)


def format_results(results: Sequence[dict]) -> str:
    """Tables of :func:`bench` results: ms per call (median and quartiles) per variant and model,
    with the device's name; compile seconds; errors against fp32; failures and skips."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=200, force_terminal=False, color_system=None)
    with console.capture() as cap:
        for train in (False, True):
            rows = [r for r in results if r["train"] == train]
            if not rows:
                continue
            variants = list(dict.fromkeys(v for r in rows for v in r["ms"]))
            table = Table(title=f"{'training step (forward + backward)' if train else 'forward'},"
                                f" ms per call: median (q1-q3); {rows[0]['gpu']}, torch "
                                f"{rows[0]['torch']}")
            table.add_column("model")
            for v in variants:
                table.add_column(v, justify="right")
            for r in rows:
                cells = []
                for v in variants:
                    t = r["ms"].get(v)
                    cells.append("-" if t is None else
                                 f"{t['median']:.3f} ({t['q1']:.3f}-{t['q3']:.3f})")
                table.add_row(_row_name(r), *cells)
            console.print(table)
        # one row per measurement, one column per model: the names are long, the figures short
        comp = Table(title="compile time, s: build and first call in this process (for "
                           "fusion_compiler up to the compiled glue); 'cold' and 'warm': first "
                           "output in a new process, empty and filled caches; 'tiered up': until "
                           "the compiled glue replaced the eager glue (compile(tiered=True))")
        comp.add_column("variant")
        for r in results:
            comp.add_column(_row_name(r), justify="right")
        keys = list(dict.fromkeys(k for r in results for k in r["compile_s"]
                                  if not k.endswith(" error")))
        for k in keys:
            comp.add_row(k, *("-" if r["compile_s"].get(k) is None
                              else f"{r['compile_s'][k]:.1f}" for r in results))
        console.print(comp)
        for r in results:
            for v, err in r.get("rel_err_vs_fp32", {}).items():
                if err is not None:
                    console.print(f"{_row_name(r)}: {v} max rel. error vs fp32 {err:.2e}")
            if "fusion_compiler" in r:
                console.print(f"{_row_name(r)}: compile(model) took {r['fusion_compiler']}")
                gflop, t = r["fusion_compiler"].get("conv_gflop"), r["ms"].get(r["first"])
                if gflop and t:
                    console.print(f"{_row_name(r)}: {gflop:.2f} GFLOP of convolutions per "
                                  f"forward, {gflop / t['median']:.3g} TFLOP/s over the whole "
                                  f"{r['first']} forward")
            if r.get("gpu_ops"):
                console.print(f"{_row_name(r)}: GPU operations per call: " + ", ".join(
                    f"{v} {n:g}" for v, n in r["gpu_ops"].items()))
        split = format_time_split(results)
        if split:
            console.print("GPU time per call by kernel category, ms (kernels):")
            console.print(split)
        for r in results:
            for v, msg in {**r.get("errors", {}), **{k: v for k, v in r["compile_s"].items()
                                                     if k.endswith(" error")}}.items():
                console.print(f"{_row_name(r)}: {v} failed: {msg}")
            for v, why in r.get("skipped", {}).items():
                console.print(f"{_row_name(r)}: {v} skipped: {why}")
    return cap.get()


def _row_name(r: dict) -> str:
    shapes = ", ".join("x".join(map(str, s)) for s in r["inputs"])
    return f"{r.get('label', r['model'])} {shapes} {r['dtype']}"


def plot(results: Sequence[dict], path: Path) -> bool:
    """Bar plot of the medians (one panel per result) to ``path``; ``False`` (nothing written)
    when matplotlib is not installed (``pip install fusion_compiler[plot]``)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = [v for v, t in r["ms"].items() if t is not None]
        medians = [r["ms"][v]["median"] for v in names]
        errors = [[m - r["ms"][v]["q1"] for v, m in zip(names, medians)],
                  [r["ms"][v]["q3"] - m for v, m in zip(names, medians)]]
        ax.barh(names, medians, xerr=errors,
                color=["tab:green" if v.startswith("fusion") else "tab:gray" for v in names])
        ax.set_xlabel("ms per step (median)" if r["train"] else "ms per call (median)")
        ax.set_title(_row_name(r), fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(f"fusion_compiler bench, {results[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(results: Sequence[dict], out: Path) -> list[Path]:
    """``bench.json``, ``bench.txt`` and (with matplotlib) ``bench.png`` in ``out``; returns the
    paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.txt"]
    written[0].write_text(json.dumps({"results": list(results)}, indent=1))
    written[1].write_text(format_results(results))
    if plot(results, out / "bench.png"):
        written.append(out / "bench.png")
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's own arguments (the model, inputs and compile options are the
    CLI's common ones)."""
    parser.add_argument("--variants", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help="comma-separated (default: all): " + ", ".join(TRAIN_VARIANTS))
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 15 on "
                        "CUDA, 5 on the CPU)")
    parser.add_argument("--iters", type=int, default=None,
                        help="calls per repetition (default: what fills 20 ms)")
    parser.add_argument("--channels-last", action="store_true",
                        help="store the parameters channels_last (inputs stay NCHW)")
    parser.add_argument("--no-compile-times", action="store_true",
                        help="skip the cold and warm compile times in new processes")
    parser.add_argument("--profile", action="store_true",
                        help="print the kernels of 20 calls of the CUDA-graph variants")
