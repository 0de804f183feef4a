"""The background thread's rule (runtime/background.py): nothing that traces or compiles runs on
it, and what does run there (lowering a specialization's regions, the post-lowering passes)
leaves a ``torch.compile``'d function called on the calling thread meanwhile alone. The GPU half,
a tight loop through a cold compile in both doors: test_gpu_background.py."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.nn as nn

from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.capture import capture
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.config import Target
from fusion_compiler.runtime.background import gc_paused, submit, warn_once
from conftest import CUDA_PIPELINE


def test_tracing_on_the_background_thread_is_refused():
    future = submit(lambda: capture(nn.Sequential(nn.Conv2d(3, 4, 3))))
    with pytest.raises(RuntimeError, match="background thread"):
        future.result(timeout=60)


def test_a_background_failure_is_one_warning_per_cause(caplog):
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        for _ in range(3):
            warn_once("lowering Net's regions", "a reason")
        warn_once("lowering Net's regions", "another reason")
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert "lowering Net's regions failed" in caplog.records[0].getMessage()


def test_lowering_on_the_background_thread_leaves_a_compiled_function_alone():
    """What tier 0's background job runs (lowering, the post-lowering passes) beside a loop of
    a ``torch.compile``'d function on the calling thread: no call raises."""
    model = randomize_(se_resnet9_fixup(3)).eval()
    compiled = CompiledModule(model, options=CUDA_PIPELINE)
    x = torch.randn(2, 3, 64, 64)
    target = Target(cuda=False)
    builder = compiled._compiler
    gm, lock = builder._passes(("x",), [x], target, lambda name, g: None)

    @torch.compile(backend="eager")
    def unrelated(t):
        return torch.relu(t) * 2

    unrelated(torch.randn(4))
    future = submit(lambda: builder._lower(gm, lock, target, ()))
    errors, calls = [], 0
    while not future.done() or calls < 50:
        try:
            unrelated(torch.randn(4))
        except Exception as exc:  # noqa: BLE001 - what the test counts
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
        calls += 1
    future.result()
    assert not errors, errors[:3]


def test_captures_pause_the_garbage_collector_and_restore_it_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner block leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a user's choice stays
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError), gc_paused():
        1 / 0
    assert gc.isenabled()
