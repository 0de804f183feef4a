"""Derived weights on the GPU (runtime/derive.py, runtime/derivations.py): every replay of an
inference CUDA graph starts with the fingerprint and derivation kernels; a derived tensor is
rewritten when, and only when, its sources' contents change, whatever wrote them. All tests carry
``@pytest.mark.gpu``."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import lowered_on_gpu, lowered_or_pytorch_faster, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.runtime.cuda_graph import CudaGraphRunner
from fusion_compiler.runtime.derive import Expr, Program, evaluate
from fusion_compiler.runtime.tiered import TieredRunner

pytestmark = pytest.mark.gpu


def _graph_runner(spec) -> CudaGraphRunner:
    run = spec.run
    while isinstance(run, TieredRunner):
        run = run.run
    assert isinstance(run, CudaGraphRunner), type(run)
    return run


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def _compiled(tmp_path):
    model = randomize_(se_resnet9_fixup(3), seed=1).cuda().half().eval()
    compiled = fc.compile(model, cache_dir=tmp_path)
    x = torch.randn(16, 3, 64, 64, device="cuda", dtype=torch.half)
    with torch.no_grad():
        compiled(x)
        assert compiled.wait_for_background_compiles(600)
        compiled(x)
    return model, compiled, x


def test_replays_derive_and_follow_writes_no_version_counter_records(tmp_path):
    """The replay holds the two derivation kernels; a fused AdamW step, ``.data`` writes and a
    copy into a buffer under ``no_grad`` (through ``.data``) are all seen."""
    model, compiled, x = _compiled(tmp_path)
    runner = _graph_runner(compiled.last)
    program = runner.derivations.program
    assert program is not None and not program.reason and program.derived, \
        runner.derivations.notes
    regions = compiled.last.regions
    assert any(lowered_on_gpu(r) for r in regions)
    assert all(lowered_or_pytorch_faster(r) for r in regions), compiled.report()
    with torch.no_grad():
        names = _kernel_names(lambda: compiled(x))
    assert any("fingerprint_kernel" in n for n in names) and \
        any("derive_kernel" in n for n in names), names
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.1
    updates = [opt.step, lambda: [p.data.mul_(0.9) for p in model.parameters()],
               lambda: model.layer3.conv2.weight.data.copy_(
                   torch.randn_like(model.layer3.conv2.weight) * 0.02)]
    for update in updates:
        update()
        with torch.no_grad():
            got = compiled(x)
            want = copy.deepcopy(model).float()(x.float())
        assert rel_err(got, want) < 2e-2


def test_a_derived_tensor_is_rewritten_only_when_its_sources_change(tmp_path):
    model, compiled, x = _compiled(tmp_path)
    program = _graph_runner(compiled.last).derivations.program
    target, _ = program.derived[0]
    with torch.no_grad():
        good = target.clone()
        target.zero_()
        compiled(x)
        torch.cuda.synchronize()
        assert not target.any()  # no source changed: the replays left it alone
        for p in model.parameters():
            p.data.add_(0.0)  # the same bytes: no change either
        compiled(x)
        torch.cuda.synchronize()
        assert not target.any()
        for p in model.parameters():
            p.data.mul_(1.25)  # exact in fp16: every value's bits change
        compiled(x)
        torch.cuda.synchronize()
        assert rel_err(target, good * 1.25) < 1e-3


def test_the_kernels_match_pytorch_on_every_dtype_and_layout():
    torch.manual_seed(0)
    w = torch.randn(64, 32, 3, 3, device="cuda", dtype=torch.half)
    s = torch.randn(1, device="cuda", dtype=torch.float32)
    b = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    srcs = [w, s, b]
    e = [Expr.source(i, t) for i, t in enumerate(srcs)]
    cases = [
        (torch.empty_like(w, memory_format=torch.channels_last), e[0]),
        (torch.empty(64, 288, device="cuda", dtype=torch.float32),
         Expr.rearranged(lambda a: a.reshape(64, 288), e[0]).times(
             Expr.rearranged(lambda a: a.expand(64, 288), e[1]))),
        (torch.empty(128, 32, 3, 3, device="cuda", dtype=torch.half).contiguous(
            memory_format=torch.channels_last),
         Expr.rearranged(lambda a, c: torch.cat([a, c.reshape(64, 1, 1, 1).expand(
             64, 32, 3, 3)], 0), e[0], e[2].scaled(1 / 9))),
    ]
    program = Program(srcs, cases)
    assert not program.reason, program.reason  # else run() recomputes them with PyTorch ops
    for dst, _ in cases:  # the program's set-up wrote them with PyTorch ops: the kernels must
        dst.zero_()  # write them again (its first run rewrites every chunk with a source)
    program.run()
    torch.cuda.synchronize()
    for dst, expr in cases:
        assert torch.allclose(dst.float(), evaluate(expr, srcs).to(dst.dtype).float())


def test_a_capture_under_autocast_casts_parameters_in_the_graph():
    """Autocast caches the fp16 cast of an fp32 parameter for the rest of its region: a capture
    that reused the warm-up's cast would replay a stale (and, once the region exits, freed)
    tensor. ``capturing`` turns the cache off, so the cast is a node of the graph."""
    from fusion_compiler.runtime.cuda_graph import capturing

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 32, device="cuda"))
    x = torch.randn(8, 32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.autocast("cuda", torch.float16):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up, as a runner's: it fills the cache
            torch.nn.functional.linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
        with capturing(graph, owner=graph):
            y = torch.nn.functional.linear(x, w)
        assert torch.is_autocast_cache_enabled()  # the caller's setting is back
        with torch.no_grad():
            w.mul_(-2.0)  # the parameter changes; the cached cast does not
        graph.replay()
        torch.cuda.synchronize()
        want = torch.nn.functional.linear(x.double(), w.double())
        assert y.dtype == torch.float16
        assert rel_err(y, want) < 2e-3
