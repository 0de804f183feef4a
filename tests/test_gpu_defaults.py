"""``compile(model)`` with no options on a GPU: tiered glue compiles, CUDA graphs with safe
outputs, the logged fallback when a forward cannot be captured, the direct (no custom op) call
path without CUDA graphs, bounded specializations that give GPU memory back, and a new batch size
answered at once, then lowered with the plan choices of the batch size tuned before. All tests
carry ``@pytest.mark.gpu``."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
import torch.nn as nn
from conftest import lowered_on_gpu, lowered_or_pytorch_faster, rel_err

import fusion_compiler as fc
import fusion_compiler.backends.cudnn.kernel as cudnn_kernel
from examples.seresnet9_fixup import bps_visual_encoder, randomize_, se_resnet9_fixup
from fusion_compiler.runtime.tiered import TieredRunner

pytestmark = pytest.mark.gpu


def _fp64(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double().cpu()(x.double().cpu())


def _reference_net() -> nn.Module:
    return randomize_(se_resnet9_fixup(3), seed=1).cuda().half().eval()


def _glue_net() -> nn.Module:
    """SE-ResNet9 with the BPS encoder's head (a convolution, then a linear layer, layer norm and
    ReLU): glue Inductor compiles (the backbone's alone is this package's kernels, which leave
    Inductor nothing to do)."""
    return randomize_(bps_visual_encoder(3), seed=1).cuda().half().eval()


def _x(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 64, 64, device="cuda", dtype=torch.half)


def _runs_triton(fn) -> bool:
    """Whether one call of ``fn`` launches a Triton (Inductor) kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any(e.name.startswith("triton_") for e in prof.events())


def test_defaults_answer_at_once_then_tier_up_to_inductor_glue_and_match_fp64(tmp_path):
    """The first calls run the regions as PyTorch ops (tier 0) while plans build, then replay a
    graph with eager glue while Inductor compiles the glue in the background; a new batch size
    during that compile gets its own tiers; both end on a graph with Inductor's kernels, and every
    output matches fp64. ``autotune=1`` is the one option: with
    timing, a region at N=32 sometimes went to PyTorch on a near tie (paired timing, H100), and
    this test checks the tiers, not the tuning (as the glue tests in test_gpu.py do)."""
    model = _glue_net()
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1)
    x, half = _x(32), _x(16)
    with torch.inference_mode():
        outs = [compiled(x)]
        spec = compiled.last
        assert isinstance(spec.run, TieredRunner) and spec.run.tier == 1
        assert not _runs_triton(lambda: compiled(x))
        outs.append(compiled(half))
        assert compiled.wait_for_background_compiles(600)
        specs = list(compiled.specializations.values())
        assert all(s.run.tier == 2 for s in specs), [s.notes for s in specs]
        assert _runs_triton(lambda: compiled(x))
        outs += [compiled(x), compiled(half)]
    assert (spec.cuda_graph, spec.glue_backend, spec.notes) == ("safe", "inductor", [])
    assert all(lowered_on_gpu(r) for s in specs for r in s.regions)
    for out, inp in zip(outs, (x, half, x, half)):
        assert rel_err(out.float().cpu(), _fp64(model, inp)) < 2e-3
    with torch.no_grad():  # parameters of the glue (the SE MLP, the layer norm), updated in place
        model.backbone.layer1.se.fc1.bias.add_(0.5)
        model.fc[2].bias.add_(0.5)
    with torch.inference_mode():
        updated = compiled(x)
    assert not torch.equal(updated, outs[2])
    assert rel_err(updated.float().cpu(), _fp64(model, x)) < 2e-3


@pytest.mark.parametrize("call_inside", [True, False])
def test_tiers_switched_from_the_other_mode_capture_in_the_specializations_mode(tmp_path,
                                                                             call_inside):
    """Calls inside ``inference_mode`` (or under ``no_grad``), the wait for the last tier from the
    other mode: every tier's CUDA graph is captured in the specialization's mode, so each call
    returns what eager returns there (inference tensors inside inference mode; normal tensors,
    which take in-place writes, under ``no_grad``), on the last tier with Inductor's glue."""
    model = _glue_net()
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1)
    x = _x(16)
    mode = torch.inference_mode if call_inside else torch.no_grad
    other = torch.no_grad if call_inside else torch.inference_mode
    with mode():
        first = compiled(x)
    with other():
        assert compiled.wait_for_background_compiles(600)
    spec = compiled.last
    with mode():
        outs = [compiled(x), compiled(x)]  # the main graph, then one that reads x in place
    assert len(compiled.specializations) == 1 and spec.run.tier == 2, spec.notes
    assert (spec.cuda_graph, spec.glue_backend) == ("safe", "inductor")
    for out in (first, *outs):
        assert out.is_inference() == call_inside
        assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3
    if not call_inside:
        outs[-1].add_(1.0)


def test_a_first_call_answers_while_plans_build_and_the_switch_times_them(tmp_path):
    """Tier 0 of a cold compile: the first call runs the regions as PyTorch ops while worker
    processes build the candidate plans; the first call after that times them on the calling
    thread (nothing else on the GPU), keeps the fastest and captures the lowered graph."""
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None)
    x = _x(16)
    with torch.inference_mode():
        first = compiled(x)
        spec = compiled.last
        assert not spec.lowered and isinstance(spec.run, TieredRunner) and spec.run.tier == 1
        assert spec.cuda_graph is None and {r.status for r in spec.regions} == {"fused"}
        assert compiled.wait_for_background_compiles(600)
        second = compiled(x)
    assert spec.lowered and spec.cuda_graph == "safe" and spec.notes == []
    assert any(sum(t.ms is not None for t in r.tuning) >= 2 for r in spec.regions)  # timed
    assert all(lowered_or_pytorch_faster(r) for r in spec.regions), [
        (r.region_id, r.reason) for r in spec.regions]
    for out in (first, second):
        assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3


def test_a_warm_start_answers_from_tier_0_then_runs_the_cached_plans(tmp_path):
    """A compile whose plans are all in the cache (a warm start) answers its first call from
    tier 0 while the background thread loads the plans (loading and the CUDA graph capture would
    otherwise come before the first output); the first call after that runs them, every cuDNN
    plan from the cache, and every output matches fp64."""
    model = _reference_net()
    x = _x(16)
    with torch.inference_mode():
        fc.compile(model, cache_dir=tmp_path, glue_backend=None).specialize(x)  # fills the cache
        warm = fc.compile(model, cache_dir=tmp_path, glue_backend=None)
        first = warm(x)
        spec = warm.last
        assert not spec.lowered and isinstance(spec.run, TieredRunner) and spec.run.tier == 1
        assert warm.wait_for_background_compiles(600)
        second = warm(x)
    assert spec.lowered and spec.cuda_graph == "safe" and spec.notes == []
    cudnn = [r for r in spec.regions if r.backend == "cudnn"]
    assert cudnn and all(r.plan_from_cache for r in cudnn)
    assert all(lowered_or_pytorch_faster(r) for r in spec.regions), [
        (r.region_id, r.reason) for r in spec.regions]
    for out in (first, second):
        assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3


def test_the_background_glue_compile_goes_through_inductors_fx_graph_cache(tmp_path):
    """Without a shape environment Inductor bypassed its FX graph cache ("No shape env"), and a
    warm process compiled the glue from scratch; AOTAutograd bypassed its own cache (its key did
    not pickle). Now both look the graph up, a hit or a miss (the graph names its regions by
    ``run_region`` keys, hashes of what each kernel computes, the same in every process)."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = fc.compile(_glue_net(), cache_dir=tmp_path)
    with torch.inference_mode():
        compiled(_x(16))
        assert compiled.wait_for_background_compiles(600)
        assert compiled.last.run.tier == 2, compiled.last.notes
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    assert inductor["fxgraph_cache_bypass"] == 0
    assert inductor["fxgraph_cache_hit"] + inductor["fxgraph_cache_miss"] >= 1
    assert aot["autograd_cache_bypass"] == 0  # AOTAutograd's cache takes the glue graph too
    assert aot["autograd_cache_hit"] + aot["autograd_cache_miss"] >= 1


def test_without_tiering_the_first_call_waits_for_inductor(tmp_path):
    compiled = fc.compile(_glue_net(), cache_dir=tmp_path, tiered=False)
    x = _x(16)
    with torch.inference_mode():
        compiled(x)
        assert not isinstance(compiled.last.run, TieredRunner)
        assert _runs_triton(lambda: compiled(x))


def test_default_outputs_survive_later_calls(tmp_path):
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None)
    with torch.inference_mode():
        x1, x2 = _x(16), _x(16)
        compiled.specialize(x1)  # lowered now (a first call would answer from tier 0)
        y1 = compiled(x1)
        kept = y1.clone()
        y2 = compiled(x2)
        assert compiled.last.cuda_graph == "safe"
        assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions)
        assert y1.data_ptr() != y2.data_ptr() and torch.equal(y1, kept)
        assert not torch.equal(y1, y2)
        assert rel_err(y2.float().cpu(), _fp64(model, x2)) < 2e-3


def test_default_outputs_are_the_graph_buffers_while_nothing_holds_the_last_ones(tmp_path):
    """A call hands out the graph's buffers when the previous call's output (or any view of it)
    is no longer held; otherwise a spare graph's copied outputs, and nothing held changes."""
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None)
    xs = [_x(16) for _ in range(4)]
    with torch.inference_mode():
        compiled.specialize(xs[0])  # lowered now (a first call would answer from tier 0)
        buffer = compiled(xs[0]).data_ptr()  # dropped at once
        y1 = compiled(xs[1])
        assert y1.data_ptr() == buffer
        view = y1[3]  # a view holds the buffer too
        kept = view.clone()
        del y1
        y2 = compiled(xs[2])
        y3 = compiled(xs[3])
        assert len({buffer, y2.data_ptr(), y3.data_ptr()}) == 3
        assert torch.equal(view, kept)
        del view
        y0 = compiled(xs[0])
        assert y0.data_ptr() == buffer
    assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions)
    for y, x in ((y0, xs[0]), (y2, xs[2]), (y3, xs[3])):
        assert rel_err(y.float().cpu(), _fp64(model, x)) < 2e-3


def test_a_caller_refilling_its_input_tensor_gets_a_graph_that_reads_it_in_place(tmp_path):
    """The second call with the same input tensor captures a direct graph (no input copy); a
    refilled tensor gives the new result; held outputs or another tensor take the copying
    graph; every output matches fp64 after all the calls."""
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None)
    buffer, other = _x(16), _x(16)
    fills = [_x(16) for _ in range(3)]
    with torch.inference_mode():
        compiled.specialize(buffer)  # lowered now (a first call would answer from tier 0)
        compiled(buffer)
        runner = compiled.last.run
        assert runner._direct is None
        buffer.copy_(fills[0])
        y0 = compiled(buffer)
        assert runner._direct and y0.data_ptr() == runner._direct.outputs.data_ptr()
        kept = y0.clone()
        buffer.copy_(fills[1])
        y1 = compiled(buffer)  # y0 is held: the copying graph
        assert y1.data_ptr() != y0.data_ptr()
        del y0
        buffer.copy_(fills[2])
        y2 = compiled(buffer)  # the direct graph again
        assert y2.data_ptr() == runner._direct.outputs.data_ptr()
        y3 = compiled(other)
    assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions)
    for y, x in ((kept, fills[0]), (y1, fills[1]), (y2, fills[2]), (y3, other)):
        assert rel_err(y.float().cpu(), _fp64(model, x)) < 2e-3


def test_a_replay_waits_for_work_queued_on_outputs_it_handed_out_on_another_stream(tmp_path):
    """Stream A takes the main graph's output buffers; a call on stream B while A's caller still
    holds them is served by the spare graph; A's caller then queues work that reads them (behind
    a sleep) and lets go; the next call on B replays the main graph again. That replay must wait
    for A's work (before, the turns waited only for the last call's stream, B, and the replay
    overwrote the buffers A's work was about to read: A's copy held B's output)."""
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None)
    xa, xb, xc, xd = (_x(16) for _ in range(4))  # each at its own address: no direct graph
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.inference_mode():
        compiled.specialize(xa)  # lowered now (a first call would answer from tier 0)
        held = compiled(xd)
        runner = compiled.last.run
        compiled(xc)  # the spare graph, captured now
        del held
        assert runner._spare, compiled.last.notes
        torch.cuda.synchronize()
        with torch.cuda.stream(a):
            ya = compiled(xa)  # the main graph's buffers, handed out on A
            main_buffer = ya.data_ptr()
        with torch.cuda.stream(b):
            b.wait_stream(a)  # the caller's own ordering of its inputs; nothing of A's after
            yb = compiled(xb)  # ya is held: the spare graph
        assert yb.data_ptr() != main_buffer
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: A's read below runs late
            copy_a = ya.clone()
        del ya
        with torch.cuda.stream(b):
            yc = compiled(xc)  # the main graph again
        assert yc.data_ptr() == main_buffer
        torch.cuda.synchronize()
    assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions)
    assert rel_err(copy_a.float().cpu(), _fp64(model, xa)) < 2e-3
    assert rel_err(yb.float().cpu(), _fp64(model, xb)) < 2e-3
    assert rel_err(yc.float().cpu(), _fp64(model, xc)) < 2e-3


@torch.fx.wrap
def _host_sync(x: torch.Tensor) -> torch.Tensor:
    """Waits for the GPU on the host: not allowed while a CUDA graph is being captured."""
    torch.cuda.synchronize()
    return x


class _Syncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return _host_sync(torch.relu(self.conv(x)))


def test_a_forward_that_cannot_be_captured_runs_without_a_graph_and_says_why_once(caplog):
    torch.manual_seed(0)
    model = _Syncing().cuda().half().eval()
    compiled = fc.compile(model, cache_dir=False, glue_backend=None)
    caplog.set_level(logging.INFO, logger="fusion_compiler")
    with torch.inference_mode():
        for n in (4, 8):
            x = torch.randn(n, 16, 8, 8, device="cuda", dtype=torch.half)
            assert rel_err(compiled(x).float().cpu(), _fp64(model, x)) < 2e-3
            compiled.wait_for_background_compiles(600)  # tier 0 first
            assert rel_err(compiled(x).float().cpu(), _fp64(model, x)) < 2e-3
            assert compiled.last.cuda_graph is None
            assert "runs without a CUDA graph" in compiled.last.notes[0]
            assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions)
            # a choice reused from N=4 whose engine knobs cuDNN rejected at N=8 is tuned anew
            assert not any("rejected" in r.reason for r in compiled.last.regions)
    logged = [r.message for r in caplog.records if "runs without a CUDA graph" in r.message]
    assert len(logged) == 1, logged
    torch.randn(4, device="cuda")  # the failed capture left the CUDA generator usable
    # and the caller's stream current (torch.cuda.graph leaves its own when capture_end raises)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


class _CpuResult(nn.Module):
    """A GPU forward that also returns a tensor it makes on the CPU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)), torch.ones(2) * 2


def test_a_forward_returning_a_tensor_made_on_the_cpu_runs_without_a_graph(caplog):
    """A capture records GPU work only: the CPU op ran once, at capture, and every replay
    handed out that one CPU tensor (a caller's write into it reached every later call's)."""
    torch.manual_seed(0)
    model = _CpuResult().cuda().half().eval()
    compiled = fc.compile(model, cache_dir=False)
    caplog.set_level(logging.INFO, logger="fusion_compiler")
    x = torch.randn(4, 16, 8, 8, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        compiled(x)
        compiled.wait_for_background_compiles(600)
        for _ in range(3):
            y, made = compiled(x)
            assert rel_err(y.float().cpu(), _fp64(model, x)[0]) < 2e-3
            assert made.device.type == "cpu" and made.tolist() == [2.0, 2.0]
            made.add_(1.0)
    assert compiled.last.cuda_graph is None
    assert any("computes on the CPU" in n for n in compiled.last.notes), compiled.last.notes
    logged = [r.message for r in caplog.records
              if r.levelno == logging.WARNING and "computes on the CPU" in r.message]
    assert len(logged) == 1, logged


def test_a_failed_capture_keeps_one_generator_state_for_graphs_and_eager_draws():
    """After a capture fails, the default generator leaves capture mode with its state kept
    (``replays.release_rng_capture``): a graph that draws, captured before, moves the same
    offset as eager ops, so its numbers are not the eager draw's that follows (with a copy of
    the state put in its place, the older graph kept the stuck state and its replay raised)."""
    from fusion_compiler.runtime.replays import release_rng_capture

    device = torch.cuda.current_device()
    generator = torch.cuda.default_generators[device]
    static = torch.empty(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static.uniform_()
    torch.cuda.current_stream().wait_stream(side)
    drawing = torch.cuda.CUDAGraph()
    with torch.cuda.graph(drawing):
        static.uniform_()
    with pytest.raises(RuntimeError), torch.cuda.stream(torch.cuda.current_stream()):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            torch.rand(8, device="cuda")  # a draw inside the capture that fails
            torch.cuda.synchronize()  # not allowed while capturing
    release_rng_capture(device)
    before = generator.get_offset()
    drawing.replay()
    assert generator.get_offset() > before
    eager = torch.empty_like(static).uniform_()
    torch.cuda.synchronize()
    assert not torch.equal(static, eager)
    assert 0.45 < float(static.mean()) < 0.55 and 0.45 < float(eager.mean()) < 0.55


def test_without_cuda_graphs_regions_are_called_directly(monkeypatch, tmp_path):
    """Inference regions run their plan straight from Python, not through the custom op (whose
    dispatch costs ~20 us a call), and ``glue_backend="auto"`` picks eager glue, which calls them
    so; training still goes through the op (autograd)."""
    calls = []
    op = cudnn_kernel.run_region
    monkeypatch.setattr(cudnn_kernel, "run_region", lambda *a: calls.append(1) or op(*a))
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, cuda_graph=False)
    x = _x(16)
    with torch.inference_mode():
        out = compiled(x)
    assert (compiled.last.cuda_graph, compiled.last.glue_backend) == (None, None) and not calls
    regions = compiled.last.regions  # cuDNN's plans ran, not PyTorch's ops
    assert any(r.backend == "cudnn" for r in regions)
    assert all(lowered_or_pytorch_faster(r) for r in regions)
    assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3
    compiled(x).float().square().mean().backward()  # training: through the op, Inductor glue
    assert calls and compiled.last.glue_backend == "inductor"


def test_bounded_specializations_give_gpu_memory_back(tmp_path):
    """40 batch sizes of similar size: memory held stops growing at 16 specializations (each
    evicted one frees its CUDA graph pool and buffers), and comes back when all are dropped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1)).cuda().half().eval()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None, autotune=1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    held = []
    with torch.inference_mode():
        for n in range(100, 140):
            x = torch.randn(n, 16, 32, 32, device="cuda", dtype=torch.half)
            assert rel_err(compiled(x).float().cpu(), _fp64(model, x)) < 2e-3
            compiled.wait_for_background_compiles(600)  # then a CUDA graph (tier 0: none)
            assert rel_err(compiled(x).float().cpu(), _fp64(model, x)) < 2e-3
            assert compiled.last.cuda_graph == "safe"
            assert all(lowered_on_gpu(r) for r in compiled.last.regions)
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated() - base)
    assert len(compiled.specializations) == 16
    assert held[39] < 1.5 * held[15], held  # without eviction: about 2.5x
    compiled.specializations.clear()
    compiled.last = None
    gc.collect()
    assert torch.cuda.memory_allocated() - base < held[15] / 4


def test_a_new_batch_size_reuses_the_plan_choice(tmp_path):
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, glue_backend=None, autotune=3)
    with torch.inference_mode():
        tuned = compiled.specialize(_x(32)).regions
        assert any(len(r.tuning) >= 2 for r in tuned if r.backend == "cudnn")
        x = _x(48)
        out = compiled(x)  # tier 0: the regions' PyTorch ops, while plans build in the background
        assert isinstance(compiled.last.run, TieredRunner) and compiled.last.run.tier == 1
        assert compiled.wait_for_background_compiles(600)
        assert rel_err(compiled(x).float().cpu(), _fp64(model, x)) < 2e-3  # the lowered graph
    assert compiled.last.cuda_graph == "safe" and compiled.last.notes == []
    regions = compiled.last.regions
    assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3
    assert [r.backend for r in regions] == [r.backend for r in tuned]  # the same decisions
    assert all(lowered_or_pytorch_faster(r) for r in regions), [
        (r.region_id, r.reason) for r in regions]
    for r in regions:
        if r.backend == "cudnn":  # one plan built, nothing timed
            assert "choice made at another batch size" in r.plan, r.plan
            assert len(r.tuning) == 1 and r.tuning[0].ms is None


class _PoolFeedsTwoRegions(nn.Module):
    """resnet's stem shape: a PyTorch op (the max pool) makes a value two regions read."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 16, 3, padding=1)
        self.a = nn.Conv2d(16, 16, 1)
        self.b = nn.Conv2d(16, 32, 1)

    def forward(self, x):
        p = torch.nn.functional.max_pool2d(torch.relu(self.stem(x)), 2)
        return torch.relu(self.a(p)).mean((2, 3)) + self.b(p).mean((2, 3))[:, :16]


def test_inductor_glue_makes_region_activations_channels_last_itself(tmp_path):
    """A value PyTorch ops make and cuDNN regions read is converted to channels_last once in the
    graph (``runtime.layout.channels_last_activations``), so Inductor writes it channels_last
    from the kernel that makes it: one replay launches no eager copy kernel (before, each region
    copied the max-pool output inside its kernel)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = _PoolFeedsTwoRegions().cuda().half().eval()
    x = torch.randn(8, 8, 32, 32, device="cuda", dtype=torch.half)
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1, tiered=False)
    with torch.inference_mode():
        err = rel_err(compiled(x).float().cpu(), _fp64(model, x))  # nothing holds the output
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(x)
            torch.cuda.synchronize()
    assert err < 2e-3
    spec = compiled.last
    assert spec.glue_backend == "inductor" and all(lowered_on_gpu(r) for r in spec.regions)
    converts = [n for n in spec.graph_module.graph.nodes if n.target == "contiguous"]
    assert len(converts) == 2, spec.graph_module.code  # the graph input and the pool's output
    copies = [e.name for e in prof.events() if e.device_type.name == "CUDA"
              and "at::native" in e.name and "copy" in e.name.lower()]
    assert not copies, copies


def test_a_compiled_model_captured_in_the_callers_own_cuda_graph_reads_the_current_weights(
        tmp_path):
    """A user who captures the compiled model in a CUDA graph of their own (after warm-up calls,
    as ``torch.cuda.graph`` asks) gets the model's forward in that graph, derivation prologue
    included: a weight updated in place between replays is read by the next replay (before, the
    call tried to replay its own graph inside the capture and raised). A first call inside a
    capture is refused in one line: compiling times kernels, which a capture forbids."""
    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1)
    x = _x(8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        compiled(x)
        compiled.wait_for_background_compiles()
        compiled(x)
    torch.cuda.current_stream().wait_stream(side)
    spec = compiled.last
    assert spec.cuda_graph == "safe" and spec.run.tier == 2, spec.notes
    assert all(lowered_on_gpu(r) for r in spec.regions), compiled.report()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = compiled(x)
    with torch.no_grad():
        conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        conv.weight.mul_(0.5)  # in place, between replays
        x.copy_(_x(8))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-2
    with pytest.raises(fc.FusionError, match="inside a CUDA graph capture"):
        with torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph()):
            fc.compile(copy.deepcopy(model), cache_dir=tmp_path)(x)


def test_plans_run_on_the_stream_of_the_thread_that_calls_them_while_another_thread_loads_plans(
        tmp_path):
    """Each thread executes plans with its own cuDNN handle: another thread asking for a handle
    (this package's background thread loading plans, a second model called from a second
    thread) no longer moves the caller's handle to its own stream between ``set_stream`` and
    ``execute`` (a plan then ran outside the caller's stream or CUDA graph capture)."""
    import threading

    from fusion_compiler.backends.cudnn.backend import CudnnBackend

    backend = CudnnBackend.shared(tmp_path)
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        mine = backend.handle(device)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(backend.handle(device)))
    t.start()
    t.join()
    assert theirs[0] != mine
    with torch.cuda.stream(side):
        assert backend.handle(device) == mine


def test_threads_calling_one_compiled_model_each_get_the_output_of_their_own_input(tmp_path):
    """Actor threads sharing one policy network: calls from several threads at once each fill
    the graph's input buffers, replay and take the outputs in turn (without the turns, as read
    from the code, one thread's input could be replayed for another), also when the threads run
    on streams of their own. A thread's first capture finds the libraries' handles made."""
    import threading

    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1)
    with torch.no_grad():
        compiled(_x(8))
        compiled.wait_for_background_compiles()
    assert compiled.last.cuda_graph == "safe", compiled.last.notes
    inputs = [_x(8) for _ in range(4)]
    with torch.no_grad():
        wanted = [model(x).float() for x in inputs]
    errors, failures = [], []

    def actor(i: int, own_stream: bool) -> None:
        try:
            with torch.no_grad(), torch.cuda.stream(torch.cuda.Stream() if own_stream
                                                    else torch.cuda.current_stream()):
                for _ in range(50):
                    out = compiled(inputs[i]).float()
                    errors.append(rel_err(out.cpu(), wanted[i].cpu()))
        except Exception as exc:  # what the thread met, for the assertion below
            failures.append(exc)

    for own_stream in (False, True):
        threads = [threading.Thread(target=actor, args=(i, own_stream)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures, failures
    assert len(errors) == 400 and max(errors) < 1e-2, max(errors)
    assert compiled.last.run.tier == 2 and compiled.last.cuda_graph == "safe"  # replays served
    # the further graphs (spare, direct) were captured by threads that had made no cuDNN handle:
    # made inside the capture, it failed and the capture with it (False), and calls ran eagerly
    runner = compiled.last.run.run
    assert runner._spare is not False and runner._direct is not False


def _at_once(actors: int, body) -> None:
    """``body(i)`` for each of ``actors`` threads, started together, each on a CUDA stream of its
    own with gradients off; raises with what any thread met."""
    import threading

    failures = []
    start = threading.Barrier(actors)

    def run(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.no_grad(), torch.cuda.stream(stream):
                start.wait()
                body(i)
            stream.synchronize()
        except Exception as exc:  # what the thread met, for the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(actors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_two_compiled_graphs_replayed_at_once_on_two_streams_keep_their_scratch_apart(
        tmp_path, monkeypatch):
    """Two runners' CUDA graphs (two models, on two capture streams, or two batch sizes of
    one, on its one stream): their cuDNN plans must get workspaces at different addresses,
    and replayed by two threads at once on streams of their own, each gets its own values.
    Before, both graphs' plans used the capture stream's one workspace (found by reading the
    code), so concurrent replays could overwrite each other's scratch."""
    from fusion_compiler.backends.cudnn.backend import CudnnBackend
    from fusion_compiler.runtime.tensors import capture_owner

    captured: dict[int, set[int]] = {}  # owner -> workspace addresses its captures got
    workspace = CudnnBackend.workspace

    def spy(self, device, nbytes):
        ws = workspace(self, device, nbytes)
        if torch.cuda.is_current_stream_capturing() and capture_owner() is not None:
            captured.setdefault(id(capture_owner()), set()).add(ws.data_ptr())
        return ws

    monkeypatch.setattr(CudnnBackend, "workspace", spy)
    models = [_reference_net(), randomize_(se_resnet9_fixup(3), seed=2).cuda().half().eval()]
    batches = [8, 16]
    compiled = [fc.compile(m, cache_dir=tmp_path, autotune=1) for m in models]
    inputs = [_x(n) for n in batches]
    with torch.no_grad():
        for c, x in zip(compiled, inputs):
            c(x)
            c.wait_for_background_compiles()
            for _ in range(3):  # every graph a call may capture, captured now
                c(x)
        wanted = [m(x).float() for m, x in zip(models, inputs)]
    assert all(c.last.cuda_graph == "safe" for c in compiled)
    assert len(captured) == 2, captured  # the two runners' captures
    first, second = captured.values()
    assert not first & second  # no scratch memory in common
    outputs: list[list[torch.Tensor]] = [[], []]

    def actor(i: int) -> None:
        for _ in range(200):  # no host synchronization between replays: they overlap
            outputs[i].append(compiled[i](inputs[i]).float())

    _at_once(2, actor)
    for i in range(2):
        errors = [rel_err(out.cpu(), wanted[i].cpu()) for out in outputs[i]]
        assert len(errors) == 200 and max(errors) < 1e-2, (i, max(errors))


class _WideHead(nn.Module):
    """A convolution, then a linear layer over 262144 features in fp32: cuBLAS computes that
    GEMM with a kernel that uses its workspace (split over the long reduction)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 64, 3, padding=1)
        self.head = nn.Linear(64 * 64 * 64, 64, bias=False)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("one_model", [False, True], ids=["two_models", "one_model_two_batches"])
def test_graphs_replayed_at_once_keep_their_gemm_scratch_apart(tmp_path, one_model):
    """PyTorch keeps one cuBLAS workspace per handle and stream, which every graph captured on
    that stream embeds. Two models' graphs are captured on two streams (their lanes) and replay
    at once; two batch sizes of one model share its stream and replay in turn. Replayed by two
    threads at once on streams of their own, each call must still give its own output, bit for
    bit as when replayed alone (a plain-PyTorch probe of graphs sharing a stream on an H200 gave
    72% of such outputs wrong). (fp32 GEMMs without TF32: PyTorch's default.)"""
    models = [_WideHead(seed).cuda().eval() for seed in (0, 1)]
    compiled = [fc.compile(m, cache_dir=tmp_path, autotune=1) for m in models]
    if one_model:
        compiled = [compiled[0], compiled[0]]
    inputs = [torch.randn(64 if i == 0 or not one_model else 32, 3, 64, 64, device="cuda")
              for i in range(2)]
    with torch.no_grad():
        for c, x in zip(compiled, inputs):
            c(x)
            c.wait_for_background_compiles()
            for _ in range(3):
                c(x)
        alone = [c(x).clone() for c, x in zip(compiled, inputs)]
        torch.cuda.synchronize()
    assert all(c.last.cuda_graph == "safe" for c in compiled)
    outputs: list[list[torch.Tensor]] = [[], []]

    def actor(i: int) -> None:
        for _ in range(150):  # no host synchronization between replays
            outputs[i].append(compiled[i](inputs[i]).clone())

    _at_once(2, actor)
    wrong = [sum(not torch.equal(o, alone[i]) for o in outputs[i]) for i in range(2)]
    assert wrong == [0, 0], wrong


class _Noisy(nn.Module):
    """A convolution plus uniform noise drawn in the forward (as a policy's exploration noise)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y + torch.rand_like(y)


def _at_last_tier(compiled, x: torch.Tensor) -> None:
    """Call ``compiled`` until its last tier serves ``x`` (gradients off)."""
    with torch.no_grad():
        compiled(x)
        compiled.wait_for_background_compiles()
        for _ in range(3):
            compiled(x)


def _seeded_draws(noisy, x: torch.Tensor) -> list[torch.Tensor]:
    """100 outputs of ``noisy`` at its last tier, alone, from CUDA seed 7 (the seed is set
    again after, for the same calls from threads)."""
    _at_last_tier(noisy, x)
    with torch.no_grad():
        torch.cuda.manual_seed(7)
        alone = [noisy(x).clone() for _ in range(100)]
        torch.cuda.synchronize()
    return alone


def test_a_graph_drawing_random_numbers_beside_another_models_draws_as_alone(tmp_path):
    """Every replay fills the default generator's seed and offset tensors, which a graph that
    draws random numbers reads: such a graph replays alone, though other models' graphs replay
    at once with one another. Its outputs from a thread, while another thread calls another
    model, are those it gives alone from the same seed, bit for bit."""
    noisy = fc.compile(_Noisy().cuda().eval(), cache_dir=tmp_path, autotune=1)
    other = fc.compile(_WideHead(0).cuda().eval(), cache_dir=tmp_path, autotune=1)
    x, y = torch.randn(16, 3, 32, 32, device="cuda"), torch.randn(64, 3, 64, 64, device="cuda")
    _at_last_tier(other, y)
    alone = _seeded_draws(noisy, x)
    assert noisy.last.cuda_graph == "safe" and other.last.cuda_graph == "safe"
    assert not torch.equal(alone[0], alone[1])  # it draws anew at every call
    torch.cuda.manual_seed(7)
    outputs: list[torch.Tensor] = []

    def actor(i: int) -> None:
        for _ in range(100 if i == 0 else 300):
            if i == 0:
                outputs.append(noisy(x).clone())
            else:
                other(y)

    _at_once(2, actor)
    assert [k for k in range(100) if not torch.equal(outputs[k], alone[k])] == []


def test_a_graph_drawing_random_numbers_while_another_thread_captures_draws_as_alone(tmp_path):
    """A capture's start fills the same seed and offset tensors a drawing graph reads (offset 0):
    captures take their turn as a replay taken alone (``replays.capture_turn``). A drawing
    model called from one thread while another thread captures graphs gives the outputs it
    gives alone from the same seed, bit for bit."""
    from fusion_compiler.runtime.cuda_graph import capturing

    noisy = fc.compile(_Noisy().cuda().eval(), cache_dir=tmp_path, autotune=1)
    x = torch.randn(64, 3, 64, 64, device="cuda")
    alone = _seeded_draws(noisy, x)
    assert noisy.last.cuda_graph == "safe"
    torch.cuda.manual_seed(7)
    outputs: list[torch.Tensor] = []
    scratch = torch.zeros(1 << 20, device="cuda")
    stream = torch.cuda.Stream()

    def actor(i: int) -> None:
        if i == 0:
            for _ in range(100):
                outputs.append(noisy(x).clone())
            return
        for _ in range(100):  # each capture begins with the generator's capture prologue
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, object(), stream=stream):
                scratch.add_(1.0)

    with torch.no_grad():
        _at_once(2, actor)
    assert [k for k in range(100) if not torch.equal(outputs[k], alone[k])] == []


def test_an_eager_fallback_call_reads_the_current_weights(tmp_path, monkeypatch):
    """A call that finds the graph's outputs still held and no spare graph (its capture failed,
    or a compile holds the lock) runs the forward eagerly: it must first bring the derived
    weights up to date (before, it read those of the last replay, stale after an update)."""
    from fusion_compiler.runtime.cuda_graph import CudaGraphRunner

    model = _reference_net()
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1)
    x = _x(8)
    with torch.no_grad():
        compiled(x)
        compiled.wait_for_background_compiles()
        compiled(x)
    assert compiled.last.cuda_graph == "safe", compiled.last.notes
    monkeypatch.setattr(CudaGraphRunner, "_try_capture", lambda self, args, pool: False)
    with torch.no_grad():
        held = compiled(x.clone())  # a new input tensor: the main graph, outputs handed out
        for p in model.parameters():  # through .data: no version counter moves; scalars too,
            p.data.mul_(0.5)  # whose products the compiled graph hoists
        again = compiled(x.clone())  # the outputs are held: the eager fallback
    assert rel_err(again.float().cpu(), _fp64(model, x)) < 2e-2
    assert rel_err(held.float().cpu(), _fp64(model, x)) > 1e-1  # the update mattered
