"""Compile times for the benchmark: seconds to the first output in new processes (cold: empty
plan, Inductor and CUDA JIT caches; warm: the caches the cold run filled), and of the first call
at half the batch in the process that compiled the full one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest.mock
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ...compiler import compile as compile_model
from .timing import sync

DOOR = "torch.compile backend=fusion_compiler"

__all__ = ["BenchRecipe", "new_process_compile_seconds", "new_batch_seconds"]


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


def new_batch_seconds(model: torch.nn.Module, inputs: Sequence[Any],
                       fusion_variants: dict[str, dict], cache_dir: str, result: dict) -> None:
    """Seconds of the first call at half the batch of a module compiled and called at the full
    one (same process, warm plan cache), and with tiering the seconds until that batch size runs
    its compiled glue (``"<label>, new batch, tiered up"``).

    The half batch's plans are built by a new plan-worker pool with an empty CUDA JIT cache
    (see :func:`new_process_compile_seconds`): what a batch size never seen on the machine
    costs, pool start included."""
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
            _new_batch_of(label, options, model, inputs, half, device, plans, result)
    plan_workers.shutdown()  # no worker outlives the JIT cache directory it was started with


def _new_batch_of(label: str, options: dict, model: torch.nn.Module,
                  inputs: Sequence[Any], half: Sequence[Any], device: torch.device,
                  cache_dir: str, result: dict) -> None:
    """One variant of :func:`new_batch_seconds`."""
    try:
        module = compile_model(model, cache_dir=cache_dir, **options)
        module(*inputs)
        module.wait_for_background_compiles()
        sync(device)
        t0 = time.perf_counter()
        module(*half)
        sync(device)
        result["compile_s"][f"{label}, new batch"] = time.perf_counter() - t0
        if not module.wait_for_background_compiles(0):
            module.wait_for_background_compiles()
            result["compile_s"][f"{label}, new batch, tiered up"] = time.perf_counter() - t0
    except Exception as exc:  # reported, the rest goes on
        result["errors"][f"{label}, new batch"] = " ".join(str(exc).split())[:300]


def new_process_compile_seconds(recipe: BenchRecipe, fusion_variants: dict[str, dict]) -> dict:
    """Cold and warm seconds to the first output of each fusion_compiler variant and (CUDA only)
    of reduce-overhead and ``torch.compile backend=fusion_compiler``, each in a new process:
    cold with empty plan, Inductor and CUDA JIT cache directories, warm with the ones the cold
    run filled. A failure is reported as ``None`` with its message under
    ``"<label>, <run> error"``; Inductor's FX graph cache and AOTAutograd's cache lookups of a
    run, where it made any, by outcome under ``"<label>, <run> caches"`` (``{"fxgraph": {"hit":
    1}, ...}``).

    The CUDA JIT cache (``CUDA_CACHE_PATH``, by default ``~/.nv/ComputeCache``) holds the
    driver's compiles of cuDNN's runtime-compiled kernels, most of a cold compile's plan building
    (measurements: docs/decisions.md, "Plan building in worker processes"). Without a fresh one a
    "cold" run would measure whatever an earlier run on the machine left there."""
    script = Path(__file__).with_name("first_output.py")
    labels = dict(fusion_variants)
    if recipe.device.startswith("cuda"):
        labels["torch.compile reduce-overhead"] = labels[DOOR] = None
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
                    lines = proc.stdout.strip().splitlines()
                    first, *tiered = lines[-1].split()
                    out[f"{label}, {run}"] = float(first)
                    if tiered:
                        out[f"{label}, {run}, tiered up"] = float(tiered[0])
                    if len(lines) > 1 and lines[-2].startswith("caches "):
                        out[f"{label}, {run} caches"] = json.loads(lines[-2][len("caches "):])
                else:
                    out[f"{label}, {run}"] = None
                    out[f"{label}, {run} error"] = " ".join(proc.stderr.split())[-300:]
    return out
