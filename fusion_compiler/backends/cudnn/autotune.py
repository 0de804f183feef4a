"""Autotuning: the timing that selects among a cuDNN graph's ranked execution plans.

cuDNN's heuristics rank the engines that can run a graph, but their first choice is often not the
fastest (measurements: docs/decisions.md, "Engine search beyond 8 ranked plans not adopted"). The
frontend exposes the ranked list (``get_execution_plan_count``, ``build_plan_at_index``: cuDNN
frontend docs, "Autotuning"); :class:`~.plan.CudnnPlan` builds the first ``autotune`` of them (in
worker processes, :mod:`.workers`), times each with
:func:`~fusion_compiler.backends.timing.gpu_time_ms` (CUDA graph replays timed with CUDA events)
on random data of the graph's own shapes, strides and dtypes (:func:`sample_pack`), and keeps the
fastest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..timing import random_tensor

__all__ = ["PlanTiming", "fastest", "sample_pack"]


@dataclass
class PlanTiming:
    """One ranked plan as autotuning saw it: ``ms`` per execution (median), or why it was skipped.

    ``build_s`` is the wall time of ``build_plan_at_index`` (seconds): runtime-compiled engines
    pay far more here than precompiled ones (measurements: docs/decisions.md, "Plan building in
    worker processes").
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


def sample_pack(tensors: dict[int, Any], device: torch.device) -> dict[int, torch.Tensor]:
    """Random device tensors for graph tensors ``{uid: cudnn tensor}``, with their dims, strides
    and dtypes."""
    return {uid: random_tensor(list(t.get_dim()), list(t.get_stride()),
                         _TORCH_DTYPE[str(t.get_data_type()).rsplit(".", 1)[-1]], device)
            for uid, t in tensors.items()}
