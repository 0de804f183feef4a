"""Which ``torch.compile`` backend compiles a graph's glue under ``glue_backend="auto"``: the rules
:func:`fusion_compiler.glue_compile.glue_backend` applies after lowering, and what lowering can
know of them before (:func:`glue_compiled_expected`: how it times a region's PyTorch ops)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.fx as fx

from ...config import CompileOptions
from ...ir.ops import calls_named
from ...kernels import triton_import_error

__all__ = ["auto_glue_backend", "glue_compiled_expected", "inductor_reason"]


def glue_compiled_expected(options: CompileOptions, gm: fx.GraphModule, training: bool) -> bool:
    """Whether Inductor will compile the glue of the fused graph ``gm`` on CUDA, as far as can be
    told before lowering (the rules of :func:`fusion_compiler.glue_compile.glue_backend`, a
    region left to PyTorch ops counting as Inductor's work, which it is): what lowering times a
    region's PyTorch ops as
    (:mod:`fusion_compiler.backends.glue_stand_in`). Off CUDA, where nothing is timed,
    ``"auto"`` counts as compiled. With ``derived_backward`` (a test option) a training region
    on PyTorch ops runs through an op Inductor cannot fuse into: not compiled."""
    if training and options.derived_backward:
        return False
    if options.glue_backend != "auto":
        return options.glue_backend == "inductor"
    if not torch.cuda.is_available():
        return True
    return auto_glue_backend(options, gm, training, lambda: True)[0] == "inductor"


def auto_glue_backend(options: CompileOptions, gm: fx.GraphModule, training: bool,
                      has_work: Callable[[], bool]) -> tuple[str | None, str]:
    """``glue_backend="auto"`` on CUDA: the backend of the glue (``"inductor"``, or ``None``
    for eager ops) and why not Inductor where that is worth a note (else ``""``);
    ``has_work()`` says whether Inductor has anything to compile (asked only where it decides).
    Used by :func:`fusion_compiler.glue_compile.glue_backend` after lowering and by
    :func:`glue_compiled_expected` before."""
    if not training and not options.cuda_graph:
        return None, ""
    if any(calls_named(n, "autograd_function_apply") for n in gm.graph.nodes):
        return None, ("glue_backend='auto': ops between regions run eagerly: the graph holds "
                      "a torch.autograd.Function (autograd_function_apply), which Dynamo "
                      "cannot trace again")
    if not has_work():
        return None, ""
    reason = inductor_reason()
    if reason:
        return None, f"glue_backend='auto': ops between regions run eagerly: {reason}"
    return "inductor", ""


@functools.cache
def inductor_reason() -> str:
    """Why Inductor cannot compile CUDA glue here (``""``: it can): Triton must import and the GPU
    must have compute capability 7.0 or newer (what Inductor's Triton backend needs)."""
    error = triton_import_error()
    if error:
        return f"Triton does not import ({error})"
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return f"the GPU has compute capability {major}.{minor}; Inductor's Triton kernels need 7.0"
    return ""
