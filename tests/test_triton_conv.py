"""The Triton implicit-GEMM convolution (backend ``triton_conv``) on the CPU: the kernel itself
under Triton's interpreter (``TRITON_INTERPRET=1``) against fp64 on small shapes, which regions it
takes, and the backend's wiring of regions to kernels (numerics through the kernel's torch-ops path,
with the backend's CUDA check lifted). tests/test_gpu_triton_conv.py runs the compiled kernel."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.seresnet9_fixup import randomized_se_resnet9_fixup
from fusion_compiler.backends import triton as triton_backend
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.kernels.conv import (CHANNEL, FULL, SCALAR, TileConfig, candidate_configs,
                                          conv_program, default_config)
from fusion_compiler.kernels.epilogue import ADD, CLAMP, DIV, MUL, RELU, SIGMOID, SILU, SUB, TANH
from conftest import CUDA_PIPELINE, WITH_TRITON_CONV, rel_err, run_interpreted, specialize


_SCRIPT = """
import json, sys
import torch
from fusion_compiler.kernels import conv_triton
from fusion_compiler.kernels.conv import ConvProgram, TileConfig, conv_reference, launch

def rel_err(a, e):
    return ((a.double() - e).abs().max() / e.abs().max()).item()

results = {}
for name, case in json.loads(sys.argv[1]).items():
    torch.manual_seed(0)
    (n, c, h, w, k, r, stride, padding, dilation, ops, kinds, outputs, layout, tile) = case
    x = torch.randn(n, c, h, w).half()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(k, c, r, r) / (c * r * r) ** 0.5).half()
    ho = (h + 2 * padding - dilation * (r - 1) - 1) // stride + 1
    wo = (w + 2 * padding - dilation * (r - 1) - 1) // stride + 1
    shapes = [(1,), (1, k, 1, 1), (n, k, ho, wo)]
    operands = [torch.rand(shapes[kind]).add(0.5).half() for kind in kinds]
    pair = lambda v: (v, v)
    program = ConvProgram(0, 1, pair(stride), pair(padding), pair(dilation),
                          tuple(range(len(kinds))), tuple(kinds), tuple(ops), tuple(outputs))
    config = TileConfig(**tile) if tile else None
    got = launch(conv_triton, x, weight, operands, program, config)
    want = conv_reference(x.double(), weight.double(), [o.double() for o in operands], program)
    results[name] = [[list(g.shape) == list(e.shape), g.dtype == torch.float16,
                      g.is_contiguous(memory_format=torch.channels_last), rel_err(g, e)]
                     for g, e in zip(got, want)]
print(json.dumps(results))
"""

SMALL = {"bm": 32, "bn": 16, "bk": 16, "group": 2}
CASES = {
    # name: (N, C, H, W, K, R, stride, padding, dilation, ops, kinds, outputs, input layout,
    #        tile configuration or None for the default one)
    "3x3, scale, bias, relu": (2, 16, 8, 8, 32, 3, 1, 1, 1, (MUL, ADD, RELU),
                               (CHANNEL, CHANNEL), (3,), "nchw", SMALL),
    "3x3/s2, ragged channels, two outputs": (2, 24, 9, 7, 40, 3, 2, 1, 1, (ADD, RELU, ADD),
                                             (SCALAR, CHANNEL), (0, 3), "channels_last",
                                             SMALL),
    "1x1, thin input, scalar add, silu": (3, 8, 5, 6, 16, 1, 1, 0, 1, (ADD, SILU), (SCALAR,),
                                          (2,), "nchw", SMALL),
    "3x3, batch norm, ReLU6 (clamp's bound an operand)": (2, 16, 6, 6, 24, 3, 1, 1, 1,
                                                          (MUL, ADD, CLAMP),
                                                          (CHANNEL, CHANNEL, SCALAR), (3,),
                                                          "channels_last", SMALL),
    "3x3 dilated, residual, sub, div, tanh, sigmoid": (1, 32, 8, 8, 24, 3, 1, 2, 2,
                                                       (ADD, SUB, DIV, TANH, SIGMOID, RELU),
                                                       (FULL, CHANNEL, SCALAR), (6, 1), "nchw",
                                                       SMALL),
    # compile()'s configuration: 64-pixel tiles for a small grid, overhangs in every dimension
    "default configuration, relu": (2, 40, 6, 6, 72, 3, 1, 1, 1, (RELU,), (), (1,),
                                    "channels_last", None),
    # split-K: fp32 partial sums into a workspace, then the epilogue kernel (shares of 5 and 4
    # of 18 reduction steps)
    "split-K 4, residual, two outputs": (2, 32, 6, 6, 24, 3, 1, 1, 1, (MUL, ADD, RELU),
                                         (CHANNEL, FULL), (0, 3), "channels_last",
                                         {**SMALL, "split": 4}),
    "split-K 3/s2, silu": (1, 48, 7, 7, 16, 3, 2, 1, 1, (ADD, SILU), (SCALAR,), (2,), "nchw",
                           {**SMALL, "split": 3}),
}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every case of :data:`CASES` run in one new process under Triton's interpreter
    (``TRITON_INTERPRET=1`` must be set before Triton is first imported, which the rest of the
    test run may have done): per case and output, [shape right, fp16, channels_last, error
    against fp64]."""
    return run_interpreted(_SCRIPT, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_fp64(case, interpreted):
    outputs = interpreted[case]
    assert len(outputs) == len(CASES[case][11])
    for shape_ok, fp16, channels_last, err in outputs:
        assert shape_ok and fp16 and channels_last
        assert err < 2e-3, (case, err)


def test_default_configuration():
    assert default_config(32768, 64, 64) == TileConfig(128, 64, 64, warps=4)  # layer0, N=128
    assert default_config(512, 512, 256) == TileConfig(64, 128, 64, warps=4)  # layer3: 32 tiles
    assert default_config(8192, 128, 64) == TileConfig(64, 128, 64, warps=4)  # 128 tiles
    assert default_config(32768, 256, 11) == TileConfig(128, 128, 16, warps=8)


def test_candidate_configurations():
    """The default first, no duplicates, every tile within Triton's and the shape's bounds."""
    for m, k, c in ((32768, 64, 64), (512, 512, 256), (96, 36, 20), (8192, 128, 3)):
        configs = candidate_configs(m, k, c)
        assert configs[0] == default_config(m, k, c) and len(set(configs)) == len(configs) > 2
        for config in configs:
            assert min(config.bm, config.bn, config.bk) >= 16
            assert config.bn <= max(16, 1 << (k - 1).bit_length())
            assert config.bk <= max(16, 1 << (c - 1).bit_length())
    # split-K where 64x128 tiles leave SMs idle: layer3 of SE-ResNet9 at N=128 (32 tiles), not
    # layer0 (512 tiles)
    assert {cfg.split for cfg in candidate_configs(512, 512, 256)} == {1, 2, 4}
    assert {cfg.split for cfg in candidate_configs(32768, 64, 64)} == {1}


def _bf16_specialization(model, x, **options):
    return specialize(model.to(torch.bfloat16).eval(), x.to(torch.bfloat16), **options)


def test_the_kernel_takes_every_se_resnet9_region():
    """All 12 (on the CPU the stem is a copy and a 1x1 convolution; on CUDA its region gets the
    SpaceToDepth as a prologue and the stem kernel instead)."""
    torch.manual_seed(0)
    spec = _bf16_specialization(randomized_se_resnet9_fixup(), torch.randn(2, 3, 64, 64),
                                fuse_prologue=False, fuse_reduction=False,
                                horizontal_fusion=False)
    programs = [conv_program(r, torch.device("cpu")) for r in spec.regions]
    assert len(programs) == 12 and not [p for p in programs if isinstance(p, str)], programs
    assert {p.ops for p in programs} == {(RELU, ADD), (ADD, RELU, ADD), (MUL, ADD), (ADD, RELU)}
    # the Fixup scalars, and the main branch that the shortcut convolutions r5, r8, r11 add
    assert {p.kinds for p in programs} == {(SCALAR,), (SCALAR, SCALAR), (FULL, SCALAR), (FULL,)}
    assert {p.stride for p in programs} == {(1, 1), (2, 2)}


class _Prologue(nn.Module):
    """A scalar add on the convolution's input, which ``fuse_prologue`` puts in its region."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, bias=False)

    def forward(self, x):
        return self.conv(x + 1.0)


@pytest.mark.parametrize("model, why", [
    (nn.Sequential(nn.Conv2d(16, 16, 3, groups=4)), "grouped"),
    (_Prologue(), "prologue"),
])
def test_regions_the_kernel_does_not_take(model, why):
    spec = _bf16_specialization(model, torch.randn(1, 16, 8, 8))
    program = conv_program(spec.regions[0], torch.device("cpu"))
    assert isinstance(program, str) and why in program


def test_float32_regions_are_not_taken():
    spec = specialize(nn.Sequential(nn.Conv2d(8, 8, 3)).eval(), torch.randn(1, 8, 8, 8))
    assert "float16 or bfloat16" in conv_program(spec.regions[0], torch.device("cpu"))


class _Residual(nn.Module):
    """conv, per-channel scale, residual add, SiLU: a full operand and a second output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.scale = nn.Parameter(torch.rand(1, 16, 1, 1) + 0.5)

    def forward(self, x):
        y = self.conv(x) * self.scale + x
        return F.silu(y), y


@pytest.mark.parametrize("make", [randomized_se_resnet9_fixup, _Residual])
def test_compile_runs_regions_on_the_triton_backend(make, monkeypatch):
    """With the backend's CUDA check lifted, ``backends`` with ``triton_conv`` give every region
    the kernel takes a :class:`ConvKernel` (its torch-ops path on the CPU): outputs as eager's."""
    monkeypatch.setattr(triton_backend, "_conv_triton_reason", lambda: "")
    torch.manual_seed(0)
    model = make().to(torch.bfloat16).eval()
    x = torch.randn(2, 16 if make is _Residual else 3, 32, 32, dtype=torch.bfloat16)
    compiled = CompiledModule(model, backends=WITH_TRITON_CONV, options=CUDA_PIPELINE)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g.float(), w.float()) < 2e-2
    backends = {r.backend for r in compiled.last.regions if not r.space_to_depth}
    assert backends == {"triton_conv"}, compiled.report()
    assert all("implicit-GEMM" in r.plan for r in compiled.last.regions if not r.space_to_depth)


def test_off_by_default_and_declined_without_cuda():
    model = nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU()).to(torch.bfloat16).eval()
    x = torch.randn(1, 8, 8, 8, dtype=torch.bfloat16)
    for options in ({}, {"backends": WITH_TRITON_CONV}):
        compiled = CompiledModule(model, options=CUDA_PIPELINE, **options)
        with torch.no_grad():
            compiled(x)
        assert compiled.last.regions[0].backend == "reference"


def test_tile_configurations_round_trip_the_plan_cache(tmp_path):
    """What autotuning records is what a later process reads; a record of another form is
    ignored (tuned again), never an error."""
    import dataclasses

    from fusion_compiler.runtime.plan_cache import PlanCache

    header = {"format": 1, "kind": "triton_conv", "inputs": [[[2, 16, 8, 8], "torch.float16"]]}
    config = TileConfig(64, 128, 64, stages=4, split=2)
    PlanCache(tmp_path).store_record(header, "triton_conv",
                                     {"config": dataclasses.asdict(config), "ms": {}})
    assert triton_backend._cached_config(PlanCache(tmp_path), header) == config
    PlanCache(tmp_path).store_record(header, "triton_conv", {"config": {"tile": 64}})
    assert triton_backend._cached_config(PlanCache(tmp_path), header) is None
    assert triton_backend._cached_config(PlanCache(tmp_path), None) is None


@pytest.mark.parametrize("make", [randomized_se_resnet9_fixup, _Residual])
def test_training_runs_the_forward_on_the_triton_backend(make, monkeypatch):
    """In training the kernel runs the forward of every region it takes, writing the values the
    backward reads (its torch-ops path on the CPU); outputs and gradients through the registered
    backward (PyTorch's convolution gradients off CUDA) are as close to fp32's as eager bf16's
    (gradients by cosine similarity: at batch 2 a bf16 gradient's largest element errors are
    noise of the same size for both)."""
    monkeypatch.setattr(triton_backend, "_conv_triton_reason", lambda: "")
    torch.manual_seed(0)
    model = make().to(torch.bfloat16).train()
    eager, reference = copy.deepcopy(model), copy.deepcopy(model).float()
    x = torch.randn(2, 16 if make is _Residual else 3, 32, 32, dtype=torch.bfloat16)
    compiled = CompiledModule(model, backends=WITH_TRITON_CONV, options=CUDA_PIPELINE)
    outputs = []
    for module, given in ((compiled, x), (eager, x), (reference, x.float())):
        out = module(given)
        outputs.append(out if isinstance(out, tuple) else (out,))
        sum(o.float().square().sum() for o in outputs[-1]).backward()
    for g, e, w in zip(*outputs):
        assert rel_err(g.float(), w) <= 1.5 * rel_err(e.float(), w) + 1e-3
    cos = lambda a, b: F.cosine_similarity(a.float().flatten(), b.flatten(), 0).item()  # noqa: E731
    for (name, p), e, q in zip(model.named_parameters(), eager.parameters(),
                               reference.parameters()):
        assert p.grad is not None, name
        if q.grad.abs().max() > 0:  # layer 3's Fixup biases get none at batch 2
            assert 1 - cos(p.grad, q.grad) <= 2 * (1 - cos(e.grad, q.grad)) + 2e-3, name
    regions = [r for r in compiled.last.regions if not r.space_to_depth]
    assert {r.backend for r in regions} == {"triton_conv"}, compiled.report()
