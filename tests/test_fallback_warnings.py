"""No silent fallback: a Triton kernel that cannot load on a machine with CUDA, and a pass after
which the graph no longer runs, each say so in one WARNING."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.nn as nn

import fusion_compiler
from fusion_compiler.kernels import load_kernel, triton_unavailable


def test_a_kernel_that_cannot_load_is_one_warning_where_cuda_is(caplog, monkeypatch):
    def broken() -> None:
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("fusion_compiler.kernels.triton_import_error", lambda: "")
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        assert load_kernel("test_kernel", broken) is None
        assert load_kernel("test_kernel", broken) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "test_kernel" in messages[0] and "PTX assembly failed" in messages[0]
    assert triton_unavailable(lambda: None) == "the Triton kernel did not load"


def test_without_cuda_a_kernel_that_cannot_load_is_no_warning(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        assert load_kernel("test_kernel_cpu", lambda: 1 / 0) is None
    assert not caplog.records


def _fails_on_real_tensors(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "meta":
        raise RuntimeError("this op runs on meta tensors only")
    return x


def test_a_pass_after_which_the_graph_does_not_run_is_a_warning(caplog):
    def breaks_the_graph(gm: fx.GraphModule) -> None:
        relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
        relu.target = _fails_on_real_tensors

    compiled = fusion_compiler.compile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()),
                                       passes={"pre_fusion": breaks_the_graph})
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        try:
            compiled(torch.randn(1, 3, 8, 8))
        except RuntimeError:
            pass  # the call runs the broken op: what matters is that the compile said so
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "after pass user:breaks_the_graph does not run" in text, text


def test_the_report_says_how_calls_run_and_why_a_default_was_not_taken():
    from fusion_compiler.tables import format_runs

    compiled = fusion_compiler.compile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    compiled(torch.randn(1, 3, 8, 8))
    compiled.last.notes.append("the forward runs without a CUDA graph: a test's reason")
    text = compiled.report()
    assert "runs:           lowered regions, glue by eager ops, no CUDA graph" in text
    assert "  note: the forward runs without a CUDA graph: a test's reason" in text
    assert format_runs({"lowered": False, "glue_backend": None, "cuda_graph": None}).startswith(
        "runs:           tier 0, the regions as PyTorch ops")
    assert "glue by inductor, a CUDA graph (safe)" in format_runs(
        {"lowered": True, "glue_backend": "inductor", "cuda_graph": "safe"})


def test_a_failed_capture_is_one_warning_and_a_note(caplog, monkeypatch):
    """A forward whose CUDA-graph capture fails runs without a graph, several times slower (the
    AMP training step of session 37: 11.2 ms a step, host-bound): one WARNING says so, the
    report's note too. Before, the note alone, logged at INFO."""
    from fusion_compiler import graphing
    from fusion_compiler.config import CompileOptions
    from fusion_compiler.runtime import cuda_graph

    def capture_fails(*args, **kwargs):
        raise cuda_graph.CaptureError("AcceleratorError: a test's capture error")

    monkeypatch.setattr(cuda_graph, "CudaGraphRunner", capture_fails)
    model = nn.Conv2d(3, 4, 3)
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        for _ in range(2):
            notes: list[str] = []
            run, how = graphing.graphed(model, model, (), notes, model=model,
                                        options=CompileOptions(), note=lambda n, r: n.append(r))
            assert run is model and how is None
            assert notes == ["the forward runs without a CUDA graph: AcceleratorError: a test's "
                             "capture error"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "a test's capture error" in messages[0], messages


def test_a_reason_given_again_is_noted_once():
    """A tier that captures its CUDA graph again (eager glue, then Inductor's) gives its
    derivation notes again: the report said "118 hoisted value(s) computed with PyTorch ops at
    every replay" twice for densenet121 (H200, session 44)."""
    from fusion_compiler.runners import note_once as _note

    notes: list[str] = []
    noted: set[str] = set()
    for _ in range(2):
        _note(noted, notes, "3 hoisted value(s) computed with PyTorch ops at every replay")
    _note(noted, notes, "another reason")
    assert notes == ["3 hoisted value(s) computed with PyTorch ops at every replay",
                     "another reason"]
