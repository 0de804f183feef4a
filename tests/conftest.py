"""Shared test helpers. Tests marked ``gpu`` skip unless CUDA and the cuDNN frontend work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is a folder of the repository, not of the package
    sys.path.insert(0, str(ROOT))


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import cudnn  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"needs the cuDNN frontend: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason is None:
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


FUSE_ALL = {"fuse_prologue": True, "fuse_reduction": True}


def specialize(model: torch.nn.Module, *inputs: torch.Tensor, backend: str = "reference",
               **options):
    """Compile ``model`` for ``inputs`` without running it; returns the Specialization.

    Unless ``options`` say otherwise, prologue and reduction fusion are on (``FUSE_ALL``): the
    pattern tests exercise everything the fuse pass can do, not only the defaults.
    """
    from fusion_compiler.compiler import CompiledModule

    with torch.no_grad():
        return CompiledModule(model, backend=backend, **{**FUSE_ALL, **options}).specialize(*inputs)


def patterns(spec) -> list[str]:
    return [r.pattern for r in spec.regions]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (expected must not be all zeros)."""
    expected = expected.double()
    scale = expected.abs().max().item()
    assert scale > 0, "reference output is all zeros: the test would prove nothing"
    return (actual.double() - expected).abs().max().item() / scale
