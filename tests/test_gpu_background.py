"""Background work never disturbs the caller (runtime/background.py): during a cold compile whose
tiers end in Inductor's glue, a loop that calls the compiled model and an unrelated
``torch.compile``'d function raises nothing, in both doors; nor does one beside warm compiles.
All tests carry ``@pytest.mark.gpu``."""

from __future__ import annotations

import time

import pytest
import torch

import fusion_compiler as fc
from examples.seresnet9_fixup import bps_visual_encoder, randomize_

pytestmark = pytest.mark.gpu


@torch.compile
def _postprocess(y: torch.Tensor) -> torch.Tensor:
    return torch.softmax(y.float() * 2.0, dim=-1).sum(-1)


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_a_tight_loop_beside_a_cold_compile_raises_nothing(door, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = randomize_(bps_visual_encoder(3), seed=1).cuda().half().eval()
    x = torch.randn(8, 3, 64, 64, device="cuda", dtype=torch.half)
    _postprocess(torch.randn(8, 4, device="cuda"))  # compiled before the loop
    run = (fc.compile(model, cache_dir=tmp_path) if door == "compile" else
           torch.compile(model, backend="fusion_compiler",
                         options={"cache_dir": str(tmp_path)}))
    errors, calls, start = [], 0, time.monotonic()
    wait = (run.wait_for_background_compiles if door == "compile" else
            fc.dynamo.wait_for_background_compiles)
    with torch.no_grad():
        while time.monotonic() - start < 300:
            for fn in (lambda: run(x), lambda: _postprocess(torch.randn(8, 4, device="cuda"))):
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - what the test counts
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
            calls += 1
            if calls > 3 and wait(0):
                break
        torch.cuda.synchronize()
    assert not errors, errors[:3]
    assert wait(0) and calls > 3


def test_a_tight_loop_beside_warm_compiles_raises_nothing(tmp_path):
    """Warm compiles (every plan in the cache: the background thread deserializes the plans in
    this process, a cuDNN call that holds the GIL) while the caller's loop runs CUDA work of its
    own on the legacy stream (PyTorch ops, which release the GIL): no call of the loop raises.
    Written for the intermittent "operation would make the legacy stream depend on a capturing
    blocking stream" of the conformance suite (docs/decisions.md, "Plans build in worker
    processes while the caller's work runs"), where the background thread was finalizing cuDNN
    plans when the caller's op failed."""
    model = randomize_(bps_visual_encoder(3), seed=1).cuda().half().eval()
    x = torch.randn(8, 3, 64, 64, device="cuda", dtype=torch.half)
    weight = torch.randn(16, 3, 3, 3, device="cuda", dtype=torch.half)
    first = fc.compile(model, cache_dir=tmp_path)
    with torch.no_grad():
        first(x)
    assert first.wait_for_background_compiles(600)  # the plan cache is full now
    errors = []
    with torch.no_grad():
        for _ in range(8):
            run = fc.compile(model, cache_dir=tmp_path)
            start = time.monotonic()
            while time.monotonic() - start < 60:
                for fn in (lambda: run(x), lambda: torch.nn.functional.conv2d(x, weight),
                           lambda: x.double().sum()):
                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001 - what the test counts
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                if run.wait_for_background_compiles(0):
                    break
            torch.cuda.synchronize()
    assert not errors, (len(errors), errors[:3])
