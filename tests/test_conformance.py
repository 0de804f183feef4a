"""The conformance suite on the CPU: every usage pattern of :mod:`conformance_patterns` through
``fusion_compiler.compile`` and ``torch.compile(backend="fusion_compiler")`` against eager
PyTorch, outputs, gradients and the module's state after the calls (the GPU half, with CUDA
graphs, plans and tiers: test_gpu_conformance.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from conformance import check, run
from conformance_patterns import PATTERNS


@functools.cache
def _eager(name: str) -> list:
    pattern = next(p for p in PATTERNS if p.name == name)
    return run(pattern, "eager", torch.device("cpu"), torch.float32).records


@pytest.mark.parametrize("pattern, door", [(p, d) for p in PATTERNS for d in p.doors],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_pattern_through_the_door_matches_eager(pattern, door):
    refused = pattern.refused.get(door)
    if refused is not None:
        with pytest.raises(refused):
            run(pattern, door, torch.device("cpu"), torch.float32)
        return
    got = run(pattern, door, torch.device("cpu"), torch.float32).records
    check(_eager(pattern.name), got, pattern.tolerance, f"{pattern.name} via {door}: ")
