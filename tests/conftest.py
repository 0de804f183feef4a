"""Shared test helpers. Tests marked ``gpu`` skip unless CUDA and the cuDNN frontend work."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_compiler.config import CompileOptions

CUDA_PIPELINE = CompileOptions().internal(cuda_pipeline=True)
"""The passes a CUDA input gets, for CPU inputs too (what ``fusion-compiler dump`` shows)."""
DERIVED_BACKWARD = CompileOptions().internal(derived_backward=True)
"""Regions on PyTorch ops also run the backward derived from their graph (as cuDNN regions do)."""

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
WITH_TRITON_CONV = ("triton_stem", "triton_conv", "dense", "triton_depthwise", "cudnn")
"""The default backends and the Triton convolution (not among them)."""


@pytest.fixture(autouse=True)
def _background_compiles_end_with_their_test():
    """A test's background glue compiles (``compile(tiered=True)``) end before the next test
    starts, so no test runs beside another's compile."""
    yield
    from fusion_compiler.runtime import background

    background.drain()


def specialize(model: torch.nn.Module, *inputs: torch.Tensor, **options):
    """Compile ``model`` for ``inputs`` without running it; returns the Specialization.

    Unless ``options`` say otherwise, prologue and reduction fusion are on (``FUSE_ALL``): the
    pattern tests exercise everything the fuse pass can do, not only the defaults; and the passes
    are those ``compile()`` runs for CUDA inputs, also for CPU inputs (``cuda_pipeline``, as the
    dump shows them); regions run as PyTorch ops (``backends=()``) unless ``options`` name
    backends.
    """
    from fusion_compiler.compiler import CompiledModule

    options = {**FUSE_ALL, "backends": (), **options}
    with torch.no_grad():
        return CompiledModule(model, CUDA_PIPELINE, **options).specialize(*inputs)


def patterns(spec) -> list[str]:
    return [r.pattern for r in spec.regions]


def lowered_on_gpu(region) -> bool:
    """Whether a region of a CUDA specialization got a GPU kernel: a cuDNN plan, the dense GEMM
    of a small image, a Triton convolution (implicit GEMM or depthwise) or the Triton kernel of
    a SpaceToDepth stem (``runtime/space_to_depth.py``, CUDA inference)."""
    return region.status == "lowered" and (
        region.backend in ("cudnn", "dense", "triton_conv", "triton_depthwise")
        or (region.backend == "triton_stem" and region.space_to_depth > 0))


def lowered_or_pytorch_faster(region) -> bool:
    """Whether a region of a CUDA specialization runs what lowering chose for it: a GPU kernel
    (:func:`lowered_on_gpu`), or its PyTorch ops where autotuning (``autotune > 1``) timed them
    faster than cuDNN's plan (``backends/cudnn/support.py``, ``slower_than_pytorch``); not a
    region that fell back for any other reason, nor one still on tier 0 (status ``"fused"``)."""
    return lowered_on_gpu(region) or (region.status == "fallback"
                                      and region.reason.startswith("PyTorch ops were faster"))


def relowered(region, **changes) -> None:
    """Change fields of ``region``'s lowering record (a test breaking a kernel on purpose, or
    standing in for what a GPU backend would have recorded)."""
    import dataclasses

    region.lowering = dataclasses.replace(region.lowering, **changes)


def needs_triton_kernel(module: str, loader: str, what: str):
    """An autouse fixture for a GPU test module of one of this package's Triton kernels: Triton
    must import, and then ``module.loader()`` must load the kernel (assign it at module level).
    A kernel that fails to load falls back to its PyTorch reference, which the tests would
    otherwise compare with itself."""
    @pytest.fixture(autouse=True, name=f"needs_triton_{loader}")
    def needs() -> None:
        pytest.importorskip("triton")
        load = getattr(importlib.import_module(module), loader)
        assert load() is not None, f"the {what} Triton kernel did not load (see the WARNING)"
    return needs


def run_interpreted(script: str, cases: dict) -> dict:
    """Run ``script`` (Python source reading ``json.loads(sys.argv[1])`` = ``cases`` and printing
    one JSON line last) in a new process under Triton's interpreter, and return what it printed.
    ``TRITON_INTERPRET=1`` must be set before Triton is first imported, which the rest of the
    test run may have done; skips without Triton."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (expected must not be all zeros)."""
    expected = expected.double()
    scale = expected.abs().max().item()
    assert scale > 0, "reference output is all zeros: the test would prove nothing"
    return (actual.double() - expected).abs().max().item() / scale


def loss(out, scale: float = 1.0) -> torch.Tensor:
    """``scale * sum(mean(o**2) + mean(o))`` over the output(s): every element gets a gradient
    that is not constant. fp16/bf16 outputs are summed in fp32; fp64 stays fp64."""
    outs = out if isinstance(out, tuple) else (out,)
    return scale * sum((lambda o: o.square().mean() + o.mean())(
        o.to(torch.promote_types(o.dtype, torch.float32))) for o in outs)


def gradients(model: torch.nn.Module, run, x: torch.Tensor, *, input_grad: bool = True,
              scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Gradients of :func:`loss` of ``run(x)`` for every parameter of ``model`` that got one (and
    ``"input"`` when ``input_grad``), as float64 copies on the CPU."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_(input_grad)
    loss(run(x), scale).backward()
    grads = {n: p.grad.to("cpu", torch.float64, copy=True) for n, p in model.named_parameters()
             if p.grad is not None}
    if input_grad:
        grads["input"] = x.grad.to("cpu", torch.float64, copy=True)
    return grads
