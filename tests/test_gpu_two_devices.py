"""A model on the second GPU, called while the first is the current device (no
``torch.cuda.set_device``): an RL actor on another GPU than the learner's, in one process. Eager
PyTorch runs the ops on the tensors' device; the doors must compute the same, at the first calls
and at the last tier, with new inputs at every call, after a weight update and from a new thread
(whose current device is the first). Needs two CUDA GPUs (``nvidia-h200-x2``); skips otherwise."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import lowered_or_pytorch_faster, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.dynamo import wait_for_background_compiles

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _check(door, model: torch.nn.Module, calls: int = 3) -> None:
    """``calls`` calls of ``door`` on new inputs each, against the module run eagerly now."""
    for _ in range(calls):
        x = torch.randn(8, 3, 64, 64, device="cuda:1", dtype=torch.half)
        with torch.no_grad():
            got, want = door(x), model(x)
        assert got.device == torch.device("cuda:1")
        assert rel_err(got.float().cpu(), want.float().cpu()) < 1e-2


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_a_model_on_the_second_gpu_called_while_the_first_is_current_computes_as_eager(
        tmp_path, door):
    torch.cuda.set_device(0)
    model = randomize_(se_resnet9_fixup(3), seed=1).to("cuda:1").half().eval()
    compiled = fc.compile(model, cache_dir=tmp_path) if door == "compile" else \
        torch.compile(model, backend="fusion_compiler", options={"cache_dir": str(tmp_path)})
    _check(compiled, model)  # the first calls
    if door == "compile":
        compiled.wait_for_background_compiles()
    else:
        wait_for_background_compiles()
    _check(compiled, model)  # the last tier, replays of a CUDA graph
    if door == "compile":
        assert compiled.last.cuda_graph == "safe", compiled.last.notes
        assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    _check(compiled, model)
    failures = []

    def thread() -> None:
        try:
            assert torch.cuda.current_device() == 0
            _check(compiled, model)
        except BaseException as exc:  # noqa: BLE001 - raised below
            failures.append(exc)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert not failures, failures
    assert torch.cuda.current_device() == 0
