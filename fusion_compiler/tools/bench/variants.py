"""The benchmark's variants and its driver, :func:`bench`: each variant built, timed and checked
against an fp32 copy in one process (see the package docstring)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from ...compiler import compile as compile_model
from ...ir.errors import InputError
from ...dynamo import wait_for_background_compiles
from ..check import floating_outputs, relative_error
from ...tables import format_gradients, format_tuning, summarize
from .compile_times import DOOR, BenchRecipe, new_batch_seconds, new_process_compile_seconds
from .profiling import gpu_ops_per_call, kernel_profile
from .timing import (device_name, fp32_convolutions, graphed, mixed_precision, sync, time_ms,
                     train_step)

__all__ = ["bench", "INFERENCE_VARIANTS", "TRAIN_VARIANTS", "ALTERNATING", "DOOR"]


# DOOR: torch.compile(model, backend="fusion_compiler") with the default options (the plan cache
# in the benchmark's directory)
INFERENCE_VARIANTS = ("eager", "eager+cudagraph", "torch.compile", "torch.compile reduce-overhead",
                      DOOR, "fusion_compiler")
TRAIN_VARIANTS = (*INFERENCE_VARIANTS, "fusion_compiler+cudagraph")
_NEEDS_CUDA = {"eager+cudagraph", "torch.compile reduce-overhead", "fusion_compiler+cudagraph"}
ALTERNATING = "fusion_compiler 2 inputs alternating"
"""The first fusion_compiler variant called with two input tensors in turn: each call passes
another tensor than the last, so its CUDA graph copies the input in (the other rows pass one
tensor every call, which a graph then reads in place: ``runtime/cuda_graph.py``)."""


def _makers(model: torch.nn.Module, inputs: Sequence[Any], train: bool,
            fusion_variants: dict[str, dict], cache_dir: str, result: dict, amp: bool = False
            ) -> dict[str, Callable[[], Callable[[], object]]]:
    """Per variant, a function that builds it and returns the callable to time."""
    def fresh() -> torch.nn.Module:  # training variants each get their own parameters
        return copy.deepcopy(model) if train else model

    device = next(t for t in inputs if isinstance(t, torch.Tensor)).device

    def mixed(fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` called under :func:`mixed_precision` (inference with ``amp``)."""
        if not amp:
            return fn

        def call() -> object:
            with mixed_precision(device, amp):
                return fn()
        return call

    first = next(iter(fusion_variants))  # the variant whose choices and tables are reported

    def ours(label: str, graph_whole_step: bool = False,
             alternate: bool = False) -> Callable[[], object]:
        options = fusion_variants[label]
        if graph_whole_step:  # the step is captured by hand: no graph inside it
            options = {**options, "cuda_graph": False}
        m = fresh()
        module = compile_model(m, cache_dir=cache_dir, progress=False, **options)  # spinner instead
        if not train:
            with mixed_precision(device, amp):  # the autocast specialization
                spec = module.specialize(*inputs)
            if label == first:  # what compile(model) chose, per region
                summary = summarize(spec)
                result["fusion_compiler"] = {"cuda_graph": spec.cuda_graph,
                                             "glue": spec.glue_backend, "notes": spec.notes,
                                             "regions": summary["regions_per_backend"],
                                             "conv_gflop": summary["conv_gflop"]}
                result["tuning"] = format_tuning(spec.regions)
            elif "triton_conv" in options.get("backends", ()):  # Triton's and cuDNN's times
                result["tuning"] = result.get("tuning", "") + f"{label}:\n" + format_tuning(
                    spec.regions)
            mixed(lambda: module(*inputs))()  # the first output, then the steady state
            module.wait_for_background_compiles()
            if alternate:
                turns = itertools.cycle((inputs, [t.clone() if isinstance(t, torch.Tensor)
                                                  else t for t in inputs]))
                return mixed(lambda: module(*next(turns)))
            return mixed(lambda: module(*inputs))
        step = train_step(m, module, inputs, amp=amp)
        step()
        if label == first:
            result["gradients"] = format_gradients(module.last.regions)
        return graphed(step) if graph_whole_step else step

    def plain(run_of: Callable[[torch.nn.Module], Callable], graph: bool = False,
              mark: bool = False) -> Callable[[], object]:
        m = fresh()
        run = run_of(m)
        fn = train_step(m, run, inputs, mark, amp) if train else mixed(lambda: run(*inputs))
        return graphed(fn) if graph else fn

    def door(m: torch.nn.Module) -> Callable[..., Any]:
        run = torch.compile(m, backend="fusion_compiler",
                            options={"cache_dir": cache_dir, "progress": False})

        def first_calls(*args: Any) -> Any:  # the first output, then the steady state
            nonlocal call
            out = run(*args)
            wait_for_background_compiles()  # plans, then the glue: calls run the last tier
            call = run
            return out

        call = first_calls
        return lambda *args: call(*args)

    makers = {
        "eager": lambda: plain(lambda m: m),
        DOOR: lambda: plain(door),
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


def _note_host_load(result: dict, name: str) -> None:
    """The host's 1-minute load average as ``name``'s timing begins, in ``result["host_load"]``,
    and its CPU count in ``result["cpus"]``: a loaded host slows what waits on it. Nothing where
    the OS gives no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return
    result.setdefault("host_load", {})[name] = round(load, 2)
    result["cpus"] = os.cpu_count()


@contextlib.contextmanager
def _status(console: Any, text: str, announce: bool = True, done: bool = True):
    """Show ``text`` on stderr while the block runs: on a terminal a live line with the seconds
    it has taken; elsewhere (a log file) one line when it starts (``announce``) and one with the
    seconds when it has ended (``done``: not for blocks a verdict line of their own follows)."""
    if console is None:
        yield
        return
    start = time.perf_counter()
    if not console.is_terminal:
        if announce:
            console.print(f"{text} ...")
        yield
        if announce and done:
            console.print(f"{text}: done in {time.perf_counter() - start:.1f} s")
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        progress.add_task(text, total=None)
        yield


def _verdict(name: str, result: dict) -> str:
    """One line on a variant, in words: its time per call and how long it took to be ready, or
    why it failed."""
    ms = result["ms"].get(name)
    if not ms:
        return f"{name}: failed: {result['errors'][name]}"
    return (f"{name}: {ms['median']:.3f} ms per call (median of {ms['reps']} x {ms['iters']} "
            f"calls); built and first call in {result['compile_s'][name]:.1f} s")


def bench(model: torch.nn.Module, inputs: Sequence[Any], *, train: bool = False,
          variants: Sequence[str] | None = None, fusion_variants: dict[str, dict] | None = None,
          reps: int | None = None, iters: int | None = None, recipe: BenchRecipe | None = None,
          profile: bool = False, compile_labels: Sequence[str] | None = None,
          progress: bool = True, amp: bool = False) -> dict:
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
        amp: automatic mixed precision as most people run networks: ``model`` in fp32, every
            call under ``torch.autocast`` (fp16 on CUDA), and in training a ``GradScaler`` and
            an SGD step in each timed step (:func:`~.timing.train_step`). The variants that
            capture a whole training step by hand are skipped (the scaler's step reads a value
            on the host), as are the new-batch and new-process compile times.

    Returns:
        ``{"model", "inputs", "dtype", "device", "gpu", "torch", "train", "ms": {variant: time_ms
        dict or None}, "compile_s": {...}, "rel_err_vs_fp32": {...}, "skipped": {variant: reason},
        "errors": {variant: message}, "profiles": {variant: table}, "kernel_time": {variant:
        :func:`kernel_categories`} (with ``profile``), "gpu_ops": {variant: GPU
        operations per call} (CUDA), "host_load": {variant: the host's 1-minute load average
        as its timing began} and "cpus" (where the OS has a load average), "first"`` (the label
        of the first fusion variant) ``}``,
        and the keys below. A variant that fails is
        reported in ``errors`` and the others go on.

    Raises:
        ValueError: ``train`` for a model without a parameter that requires grad.
    """
    from rich.console import Console  # noqa: PLC0415

    console = Console(stderr=True, soft_wrap=True, highlight=False) if progress else None
    if train and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"bench with train=True (--train) times training steps: "
                         f"{type(model).__name__} has no parameter that requires grad")
    first = next(t for t in inputs if isinstance(t, torch.Tensor))
    device = first.device
    fusion_variants = fusion_variants or {"fusion_compiler": {}}
    names = list(variants) if variants is not None else [
        *(v for v in (TRAIN_VARIANTS if train else INFERENCE_VARIANTS) if v != "fusion_compiler"),
        *fusion_variants, *(() if train else (ALTERNATING,))]
    result: dict = {"model": type(model).__name__, "inputs": [list(t.shape) for t in inputs],
                    "dtype": str(first.dtype).removeprefix("torch.") + (
                        ", autocast " + ("float16" if device.type == "cuda" else "bfloat16")
                        if amp else ""), "device": str(device),
                    "gpu": device_name(device), "torch": torch.__version__, "train": train,
                    "ms": {}, "compile_s": {}, "skipped": {}, "errors": {},
                    "first": next(iter(fusion_variants))}
    reps = reps or (15 if device.type == "cuda" else 5)
    cache_dir = tempfile.mkdtemp(prefix="fc-bench-plans-")
    makers = _makers(model, inputs, train, fusion_variants, cache_dir, result, amp)
    unknown = [v for v in names if v not in makers]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {sorted(makers)}")
    shapes = ", ".join("x".join(map(str, t.shape)) for t in inputs if isinstance(t, torch.Tensor))
    try:  # an fp32 copy in true fp32: the errors' reference, and a check that the inputs fit
        with torch.inference_mode(), fp32_convolutions():
            reference = floating_outputs(copy.deepcopy(model).float()(*[
                t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in inputs]))
    except Exception as exc:  # the user's inputs (or model): one clear error, not per variant
        raise InputError(f"{type(model).__name__} does not run on inputs of shape {shapes}: "
                         f"{' '.join(str(exc).split())}") from exc
    if train:
        reference = None
    else:
        result["rel_err_vs_fp32"] = {}
    first_fusion = result["first"]
    built: dict[str, Callable[[], object]] = {}  # kept for the profiler, after all timings
    grad = torch.enable_grad() if train else torch.inference_mode()
    with grad:
        for name in names:
            if name in _NEEDS_CUDA and device.type != "cuda":
                result["skipped"][name] = "needs CUDA"
                continue
            if amp and train and name in ("eager+cudagraph", "fusion_compiler+cudagraph"):
                result["skipped"][name] = "GradScaler's step reads a value on the host"
                continue
            try:
                with _status(console, f"bench: building and calling {name}", done=False):
                    t0 = time.perf_counter()
                    fn = makers[name]()
                    fn()
                    sync(device)
                    result["compile_s"][name] = time.perf_counter() - t0
                _note_host_load(result, name)
                with _status(console, f"bench: timing {name}", announce=False):
                    result["ms"][name] = time_ms(fn, device, reps, iters)
                if reference is not None:
                    out = floating_outputs(fn())
                    result["rel_err_vs_fp32"][name] = max(
                        relative_error(o, r) for o, r in zip(out, reference)) if out else None
                    # not held into the profile: a CUDA-graph runner whose last outputs are still
                    # held replays its copying graph (an input copy per call)
                    del out
                built[name] = fn
            except Exception as exc:  # one broken variant must not hide the others
                result["ms"][name] = None
                result["errors"][name] = " ".join(str(exc).split())[:300] or repr(exc)
            if console is not None:
                console.print(_verdict(name, result), highlight=False)
        # The profiler runs after all timings, so no variant is timed after a profiler session
        # and another not (whether one changes later host-side launch cost is not settled;
        # docs/decisions.md, "Benchmarked models in processes of their own")
        for name, fn in built.items() if device.type == "cuda" else ():
            try:
                result.setdefault("gpu_ops", {})[name] = gpu_ops_per_call(fn)
                if profile and name in (first_fusion, "torch.compile reduce-overhead", DOOR,
                                        "fusion_compiler+cudagraph", "eager+cudagraph"):
                    table, split = kernel_profile(fn)
                    result.setdefault("profiles", {})[name] = table
                    result.setdefault("kernel_time", {})[name] = split
            except Exception as exc:  # reported, the rest goes on
                result["errors"][f"{name}, profile"] = " ".join(str(exc).split())[:300]
        built.clear()
        # compile times of the fusion variants that ran (none when not asked for)
        timed = {k: fusion_variants[k] for k in compile_labels or list(fusion_variants)[:1]
                 if k in names}
        if timed and not train and not amp and first.dim() > 0 and first.shape[0] >= 2:
            with _status(console, "bench: first call at half the batch"):
                new_batch_seconds(model, inputs, timed, cache_dir, result)
    if recipe is not None and timed and not train and not amp:
        if sys.flags.dont_write_bytecode and console is not None:
            console.print("bench: Python writes no bytecode cache here (PYTHONDONTWRITEBYTECODE): "
                          "each new process compiles the sources it imports, and its start-up "
                          "times include that")
        with _status(console, "bench: compile times in new processes (cold and warm)"):
            result["compile_s"].update(new_process_compile_seconds(recipe, timed))
    return result
