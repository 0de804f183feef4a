"""What ``fusion-compiler dump`` does: compile a model for inspection (nothing runs) and describe
the result with :mod:`fusion_compiler.report`."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..compiler import CompiledModule, Specialization
from ..passes import default_passes
from .report import DEFAULT_STAGES, describe

__all__ = ["specialize_for_dump", "dump"]


def specialize_for_dump(model: torch.nn.Module, inputs: Sequence[Any], *, backend: str = "auto",
                        **options: Any) -> Specialization:
    """Compile ``model`` for ``inputs`` (under ``torch.no_grad`` unless the model is in training
    mode) and return the :class:`~fusion_compiler.compiler.Specialization`, without running it.

    ``options`` are :func:`fusion_compiler.compile`'s (``cache_dir``, ``autotune``,
    ``fuse_prologue``, ``fuse_reduction``, ``concurrent_branches``). The specialization is
    compiled without a CUDA graph and without a glue backend (both only change how the graph is
    called, not its regions; so no region is scheduled on a side stream, but with
    ``concurrent_branches`` the regions are those it gets), and with the passes ``compile()`` runs
    for CUDA inputs whatever the inputs' device (the cuDNN layout rewrites included, see
    :func:`~fusion_compiler.passes.default_passes`), so a machine without a GPU shows the graphs a
    GPU gets.
    """
    if "passes" not in options:
        options["passes"] = default_passes(
            fuse_prologue=options.pop("fuse_prologue", False),
            fuse_reduction=options.pop("fuse_reduction", False),
            concurrent_branches=options.pop("concurrent_branches", False))
    compiled = CompiledModule(model, backend=backend, **{"cuda_graph": False, "glue_backend": None,
                                                         **options})
    with torch.set_grad_enabled(model.training):
        return compiled.specialize(*inputs)


def dump(model: torch.nn.Module, inputs: Sequence[Any], *, backend: str = "auto",
         stages: Sequence[str] = DEFAULT_STAGES, **options: Any) -> dict:
    """:func:`~fusion_compiler.report.describe` of :func:`specialize_for_dump`: compile ``model``
    for ``inputs`` and describe the result (``options`` as for :func:`specialize_for_dump`).

    Raises:
        ValueError: an unknown stage name.
        FusionError: the model cannot be captured or breaks the cuDNN graph rules.
    """
    return describe(specialize_for_dump(model, inputs, backend=backend, **options), stages)
