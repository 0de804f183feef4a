"""The conformance suite on the GPU: every usage pattern of :mod:`conformance_patterns` through both
doors against eager PyTorch in fp16, with the defaults (cuDNN plans, CUDA graphs, derivation
prologues, tiers). Each pattern runs twice per door: its calls answered as they come (the first
tiers while plans build), and each call made after its specialization was compiled and the
background compiles ended (the last tier), where the compile door's regions must run on GPU kernels
(the fast path), or on PyTorch ops only where lowering timed those faster. The CPU half:
test_conformance.py."""

from __future__ import annotations

import functools

import pytest
import torch

from conformance import check, run
from conformance_patterns import PATTERNS
from conftest import lowered_or_pytorch_faster

pytestmark = pytest.mark.gpu
FP16_TOLERANCE = 3e-2
"""Relative error allowed per value: fp16 rounds at 2**-11, and the compiled graph rounds in other
places than eager does (fused epilogues, folded batch norm), through training steps too."""


@functools.cache
def _eager(name: str) -> list:
    pattern = next(p for p in PATTERNS if p.name == name)
    return run(pattern, "eager", torch.device("cuda"), pattern.gpu_dtype).records


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory) -> str:
    """One plan cache for the module: the patterns share their models' shapes."""
    return str(tmp_path_factory.mktemp("plans"))


@pytest.mark.parametrize("settle", [False, True], ids=["first_calls", "last_tier"])
@pytest.mark.parametrize("pattern, door", [(p, d) for p in PATTERNS for d in p.doors],
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_pattern_through_the_door_matches_eager_on_the_gpu(pattern, door, settle, plan_cache):
    options = {"cache_dir": plan_cache}
    refused = pattern.refused.get(door)
    if refused is not None:
        with pytest.raises(refused):
            run(pattern, door, torch.device("cuda"), pattern.gpu_dtype, options, settle)
        return
    session = run(pattern, door, torch.device("cuda"), pattern.gpu_dtype, options, settle)
    check(_eager(pattern.name), session.records, max(pattern.tolerance, FP16_TOLERANCE),
          f"{pattern.name} via {door}: ")
    compiled = session.run
    if settle and door == "compile":  # a root pre-hook may have changed the last call's inputs
        compiled.wait_for_background_compiles()
    if settle and door == "compile" and getattr(compiled, "last", None) is not None:
        regions = compiled.last.regions
        # a region runs a GPU kernel or, where lowering timed them faster (as compiled glue runs
        # them), its PyTorch ops: the one-convolution patterns at N=2 on an H200 (session 41)
        assert not regions or any(lowered_or_pytorch_faster(r) for r in regions), \
            compiled.report()
        # ops timed as compiled glue runs them must run in compiled glue
        if any(r.status == "fallback" and "as compiled glue runs them" in r.reason
               for r in regions):
            assert compiled.last.glue_backend == "inductor", compiled.report()
