"""cuDNN execution on a GPU: every fused pattern runs through cuDNN and matches an fp64 reference.

All tests carry ``@pytest.mark.gpu`` and skip without CUDA and the cuDNN frontend.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import FUSE_ALL, lowered_on_gpu, lowered_or_pytorch_faster, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import bps_visual_encoder, randomize_, se_resnet9_fixup
from test_fuse_patterns import PATTERNS

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def _fp64_reference(model: nn.Module, *inputs: torch.Tensor):
    ref = copy.deepcopy(model).double().cpu()
    with torch.no_grad():
        return ref(*(x.double().cpu() for x in inputs))


def _run_cudnn(model: nn.Module, x: torch.Tensor, dtype=torch.float16, tol=2e-3, **options):
    model = model.to("cuda", dtype).eval()
    x = x.to("cuda", dtype)
    options.setdefault("autotune", 1)  # heuristics' first plan: fast to build, same numerics
    options.setdefault("cuda_graph", False)  # the regions, not the runtime around them
    options.setdefault("glue_backend", None)  # (Inductor would compile for every pattern)
    compiled = fc.compile(model, cache_dir=False, **options)
    with torch.inference_mode():
        got = compiled(x)
    want = _fp64_reference(model, x)
    pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
    for g, w in pairs:
        assert rel_err(g.float().cpu(), w) < tol
    regions = compiled.last.regions
    measured = options["autotune"] > 1  # then a region PyTorch runs faster stays on PyTorch
    assert regions and all(lowered_on_gpu(r) or measured and
                           r.reason.startswith("PyTorch ops were faster") for r in regions), [
        (r.region_id, r.pattern, r.reason) for r in regions]
    return compiled, got


@pytest.mark.parametrize("fusion", ["default", "all"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pattern_runs_on_cudnn(name, dtype, fusion):
    torch.manual_seed(0)
    factory, shape = PATTERNS[name]
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 2e-3}[dtype]  # fp32: TF32
    _run_cudnn(factory(), torch.randn(shape), dtype=dtype, tol=tol,
               **(FUSE_ALL if fusion == "all" else {}))


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_a_batch_of_one_runs_the_same_regions_on_cudnn(name):
    """At N = 1 every pattern forms the regions it forms at N = 8 (a per-channel operand is not
    taken for a per-sample gate there, session 42) and runs them on cuDNN within fp16's
    tolerance of fp64."""
    torch.manual_seed(0)
    factory, shape = PATTERNS[name]
    model = factory()
    compiled, _ = _run_cudnn(model, torch.randn((1, *shape[1:])))
    with torch.inference_mode():  # as _run_cudnn calls it: inference (horizontal fusion runs)
        wide = fc.compile(copy.deepcopy(model), cache_dir=False, autotune=1, cuda_graph=False,
                          glue_backend=None).specialize(torch.randn(shape, device="cuda").half())
    assert [r.pattern for r in compiled.last.regions] == [r.pattern for r in wide.regions]


@pytest.mark.parametrize("channels, batch", [(3, 128), (11, 512)])
@pytest.mark.parametrize("fusion", ["default", "all"])
def test_reference_network_fp16(channels, batch, fusion):
    model = randomize_(se_resnet9_fixup(channels), seed=channels)
    options = FUSE_ALL if fusion == "all" else {"autotune": 8}  # the default path, autotuned
    compiled, out = _run_cudnn(model, torch.randn(batch, channels, 64, 64), **options)
    regions = compiled.last.regions
    assert len(regions) == 9  # 12 convolutions; layers 1-3 merge two each (horizontal fusion)
    assert out.is_contiguous()  # NCHW in, NCHW out: the memory format eager returns
    if fusion == "all":  # the Fixup prologues and the SE squeezes lower and run on cuDNN
        # layer0's two convolutions and the three merged ones (whose epilogue took the second
        # convolution's `x + bias` of layers 1-3)
        assert sum(r.pattern.startswith("[add]") for r in regions) == 5
        assert sum(r.pattern.endswith("+ sum_hw") for r in regions) == 4
    else:  # every region autotuned, then timed against its PyTorch ops; the faster one runs
        assert regions[0].backend == "triton_stem" and regions[0].space_to_depth == 4  # the stem
        for r in regions[1:]:
            if r.backend == "dense":  # layer3's 3x3 convolution of 2x2 images, timed vs cuDNN
                assert r.timing["dense"] < r.timing["cudnn"], (r.region_id, r.timing)
                continue
            assert len(r.tuning) >= 2 and min(t.ms for t in r.tuning if t.ms) > 0
            faster = "reference" if r.timing["reference"] < 0.9 * r.timing["cudnn"] else "cudnn"
            assert r.backend == faster, (r.region_id, r.timing)


def test_visual_encoder_fp16():
    _run_cudnn(randomize_(bps_visual_encoder(3)), torch.randn(64, 3, 64, 64))


def test_channels_last_input_and_batch_change():
    model = randomize_(se_resnet9_fixup(3)).cuda().half().eval()
    compiled = fc.compile(model, cache_dir=False, glue_backend=None)
    with torch.inference_mode():
        for n, fmt in ((32, torch.channels_last), (48, torch.contiguous_format)):
            x = torch.randn(n, 3, 64, 64, device="cuda", dtype=torch.half).contiguous(
                memory_format=fmt)
            compiled.specialize(x)  # lowered now (a first call would answer from tier 0)
            got, eager = compiled(x), model(x)
            assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions), \
                compiled.report()
            assert got.shape == (n, 512, 2, 2)
            assert got.is_contiguous(memory_format=torch.channels_last) == eager.is_contiguous(
                memory_format=torch.channels_last) or got.is_contiguous() == eager.is_contiguous()
            assert rel_err(got.float().cpu(), _fp64_reference(model, x)) < 2e-3
    assert len(compiled.specializations) == 2


def test_cuda_graph_matches_plain_execution():
    model = randomize_(se_resnet9_fixup(3)).cuda().half().eval()
    plain = fc.compile(model, cache_dir=False, cuda_graph=False,
                       glue_backend=None)
    graphed = fc.compile(model, cache_dir=False, glue_backend=None)
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(128, 3, 64, 64, device="cuda", dtype=torch.half)
            graphed.specialize(x)  # lowered now (a first call would answer from tier 0)
            assert torch.equal(graphed(x).clone(), plain(x))
    assert graphed.last.cuda_graph == "safe"
    assert all(lowered_or_pytorch_faster(r) for c in (plain, graphed) for r in c.last.regions)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_fp32_weights_under_autocast_run_the_half_precision_kernels(mode):
    """The mixed-precision recipe (fp32 weights and image, ``torch.autocast(fp16)``) with the
    defaults, as ``examples/benchmark.py --models seresnet9-rgb-amp`` runs it: the stem on its
    Triton kernel (rounding the fp32 image as it loads it), the other regions on GPU kernels,
    the SE blocks in ``se_scale``, the output in eager's fp32, at eager autocast's accuracy."""
    model = randomize_(se_resnet9_fixup(3)).cuda().eval()
    x = torch.randn(128, 3, 64, 64, device="cuda")
    compiled = fc.compile(model, cache_dir=False)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context(), torch.autocast("cuda", dtype=torch.float16):
        compiled(x)  # tier 0, then the background compiles
        compiled.wait_for_background_compiles()
        got, eager = compiled(x), model(x)
    regions = compiled.last.regions
    assert got.dtype == eager.dtype == torch.float32
    assert regions[0].backend == "triton_stem", compiled.report()
    assert all(lowered_or_pytorch_faster(r) for r in regions), compiled.report()
    assert "se_scale x4" in compiled.report(), compiled.report()
    want = _fp64_reference(model, x)
    assert rel_err(got.cpu(), want) <= 1.5 * rel_err(eager.cpu(), want) + 1e-4


def test_inductor_glue_with_cuda_graph_matches_plain_execution():
    """``glue_backend="inductor"``: the ops between regions run as Inductor kernels, regions as
    cuDNN plans, all captured in one CUDA graph. ``autotune=1``: no region goes to PyTorch by
    timing (with timing, r0 and r6 each did on some runs, near ties on the H100)."""
    model = randomize_(se_resnet9_fixup(3)).cuda().half().eval()
    plain = fc.compile(model, cache_dir=False, cuda_graph=False,
                       glue_backend=None, autotune=1)
    glued = fc.compile(model, cache_dir=False, cuda_graph=True,
                       glue_backend="inductor", tiered=False, autotune=1)
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(128, 3, 64, 64, device="cuda", dtype=torch.half)
            assert rel_err(glued(x).clone().float(), plain(x).float()) < 2e-3
    assert all(lowered_on_gpu(r) for r in glued.last.regions)
    assert glued.last.cuda_graph == "safe"


def test_cpu_input_to_cuda_model_is_a_value_error():
    compiled = fc.compile(nn.Conv2d(8, 8, 3).cuda().half())
    with pytest.raises(ValueError, match="is on cpu but the model's parameters are on cuda"):
        compiled(torch.randn(1, 8, 8, 8, dtype=torch.half))


_CACHE_SCRIPT = textwrap.dedent("""
    import json, sys, torch, fusion_compiler as fc
    sys.path.insert(0, {root!r})
    from examples.seresnet9_fixup import se_resnet9_fixup, randomize_
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).cuda().half().eval()
    x = torch.randn(16, 3, 64, 64, device="cuda", dtype=torch.half)
    # autotune=1: no timing, so both processes make the same choices (timed choices may differ)
    compiled = fc.compile(model, cache_dir={cache!r}, autotune=1,
                          glue_backend=None)
    with torch.inference_mode():
        compiled.specialize(x)  # lowered now (a first call would answer from tier 0)
        y = compiled(x)
    print(json.dumps({{"cached": [r.plan_from_cache for r in compiled.last.regions],
                      "backends": [r.backend for r in compiled.last.regions],
                      "sum": y.float().sum().item()}}))
""")


def _cache_run(cache: Path) -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT.format(root=str(ROOT), cache=str(cache))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_disk_cache_round_trip_in_a_second_process(tmp_path):
    first, _ = _cache_run(tmp_path)
    # the SpaceToDepth stem (r0) is usually a Triton kernel, no plan: plan_from_cache None (on a
    # loaded host its timing may choose cuDNN: not asserted); so is the dense GEMM that layer3's
    # 2x2 images may get (its choice over cuDNN is cached, not its plan)
    cudnn = [i for i, b in enumerate(first["backends"]) if b == "cudnn"]
    assert first["backends"][0] in ("triton_stem", "cudnn")
    assert len(cudnn) >= 7 and not any(first["cached"])
    second, _ = _cache_run(tmp_path)
    assert second["backends"] == first["backends"]
    assert [second["cached"][i] for i in cudnn] == [True] * len(cudnn)
    assert second["sum"] == first["sum"]
    for entry in tmp_path.glob("*.plan"):  # corrupt every entry: warned about, rebuilt, same result
        entry.write_bytes(b"garbage")
    third, stderr = _cache_run(tmp_path)
    assert not any(third["cached"]) and "rebuilding the plan" in stderr
    assert third["sum"] == first["sum"]


def test_pytorch_timing_is_cached_with_the_plan(tmp_path):
    """A compile that loads plans from the cache reuses their PyTorch-vs-cuDNN timings: the same
    choices, nothing re-timed (warm compiles stay fast, processes agree)."""
    model = randomize_(se_resnet9_fixup(3)).cuda().half().eval()
    x = torch.randn(32, 3, 64, 64, device="cuda", dtype=torch.half)
    runs = []
    for _ in range(2):
        compiled = fc.compile(model, [x], cache_dir=tmp_path, autotune=2,
                              cuda_graph=False, glue_backend=None)
        runs.append(compiled.specialize(x).regions)
    first, second = runs
    assert all(r.plan_from_cache for r in second)
    assert [r.timing for r in second] == [r.timing for r in first]
    assert [r.backend for r in second] == [r.backend for r in first]


class _NarrowHead(nn.Module):
    """A conv with 6 output channels (a multiple of neither 8 nor 4: padded for cuDNN), a
    per-channel bias, a residual read after the conv, a ReLU, and the H, W sum of the result."""

    def __init__(self, in_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 6, 3, padding=1, bias=False)
        self.bias = nn.Parameter(torch.rand(1, 6, 1, 1) - 0.5)

    def forward(self, x, residual):
        y = torch.relu(self.conv(x) + self.bias + residual)
        return y, y.sum((2, 3), keepdim=True)


@pytest.mark.parametrize("in_channels", [16, 5])  # 5: input channels padded too
@pytest.mark.parametrize("fusion", ["default", "all"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_channels_padded_for_cudnn(dtype, fusion, in_channels):
    torch.manual_seed(0)
    model = _NarrowHead(in_channels).to("cuda", dtype).eval()
    x = torch.randn(4, in_channels, 9, 9, device="cuda", dtype=dtype)
    residual = torch.randn(4, 6, 9, 9, device="cuda", dtype=dtype)
    want = _fp64_reference(model, x, residual)
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 3e-3}[dtype]
    options = FUSE_ALL if fusion == "all" else {}
    for runtime in ({"cuda_graph": False, "glue_backend": None}, {}):  # direct; graph + glue
        compiled = fc.compile(model, cache_dir=False, autotune=1,
                              **options, **runtime)
        with torch.inference_mode():
            compiled.specialize(x, residual)  # lowered now (a call would answer from tier 0)
            compiled.wait_for_background_compiles()  # and Inductor's glue, where it has any
            got = compiled(x, residual)
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel_err(g.float().cpu(), w) < tol
        assert got[0].is_contiguous(memory_format=torch.channels_last) or got[0].is_contiguous()
        region = compiled.last.regions[0]
        assert (region.backend, region.status) == ("cudnn", "lowered"), region.reason


def test_padded_output_channels_stay_on_pytorch_in_training():
    model = _NarrowHead(16).to("cuda", torch.float16).train()
    x = torch.randn(4, 16, 9, 9, device="cuda", dtype=torch.float16)
    residual = torch.randn(4, 6, 9, 9, device="cuda", dtype=torch.float16)
    compiled = fc.compile(model, cache_dir=False, autotune=1)
    out, _ = compiled(x, residual)
    out.float().sum().backward()
    region = compiled.last.regions[0]
    assert region.backend == "reference" and "inference only" in region.reason
    assert model.conv.weight.grad is not None
