"""What ``fusion-compiler dump`` does: compile a model for inspection (nothing runs) and describe
the result with :mod:`fusion_compiler.tools.report`."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..compiler import CompiledModule, Specialization
from ..config import CompileOptions
from ..ir.region import Region
from ..passes import PassManager, glue
from ..runtime.tiered import isolated_copy
from .report import DEFAULT_STAGES, describe

__all__ = ["specialize_for_dump", "dump"]


def specialize_for_dump(model: torch.nn.Module, inputs: Sequence[Any], **options: Any
                        ) -> Specialization:
    """Compile ``model`` for ``inputs`` (under ``torch.no_grad`` unless the model is in training
    mode) and return the :class:`~fusion_compiler.specialization.Specialization`, without running
    it.

    ``options`` are :func:`fusion_compiler.compile`'s, made what a dump needs by
    :meth:`~fusion_compiler.config.CompileOptions.for_dump`: no CUDA graph and no glue backend
    (both only change how the graph is called, not its regions), and the
    passes ``compile()`` runs for CUDA inputs whatever the inputs' device, so a machine without
    a GPU shows the graphs a GPU gets. The glue pipeline, which runs on the copy of the graph
    Inductor compiles, is run on a copy here so that its stages can be shown too.

    Raises:
        TypeError, ValueError: an unknown or invalid option.
    """
    compiled = CompiledModule(model, CompileOptions.from_kwargs(**options).for_dump())
    with torch.set_grad_enabled(model.training):
        spec = compiled.specialize(*inputs)
    shown = isolated_copy(spec.graph_module, opaque=lambda m: isinstance(m, Region))
    PassManager(glue(), propagate=False,
                on_stage=lambda name, g: spec.stages.__setitem__(name, g.code)).run(shown)
    return spec


def dump(model: torch.nn.Module, inputs: Sequence[Any], *,
         stages: Sequence[str] = DEFAULT_STAGES, **options: Any) -> dict:
    """:func:`~fusion_compiler.tools.report.describe` of :func:`specialize_for_dump`: compile
    ``model`` for ``inputs`` and describe the result (``options`` as for
    :func:`specialize_for_dump`).

    Raises:
        ValueError: an unknown stage name.
        FusionError: the model cannot be captured or breaks the cuDNN graph rules.
    """
    return describe(specialize_for_dump(model, inputs, **options), stages)
