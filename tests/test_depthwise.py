"""The depthwise convolution kernel (backend ``triton_depthwise``) on the CPU: the kernel itself
under Triton's interpreter (``TRITON_INTERPRET=1``) against fp64 on small shapes, which regions
it takes, and the backend's wiring of regions to kernels (numerics through the kernel's
torch-ops path, with the backend's CUDA check lifted). tests/test_gpu_depthwise.py runs the
compiled kernel and its timing against cuDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_compiler.backends import triton_depthwise
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.config import DEFAULT_BACKENDS
from fusion_compiler.kernels.conv import CHANNEL, FULL, SCALAR, conv_program
from fusion_compiler.kernels.depthwise import (candidate_configs, default_config,
                                               depthwise_program)
from fusion_compiler.kernels.epilogue import ADD, CLAMP, DIV, MUL, RELU, SIGMOID, SILU, SUB, TANH
from conftest import CUDA_PIPELINE, rel_err, run_interpreted, specialize


_SCRIPT = """
import json, sys
import torch
from fusion_compiler.kernels import depthwise, depthwise_triton
from fusion_compiler.kernels.conv import ConvProgram, TileConfig
from fusion_compiler.kernels.depthwise import depthwise_reference, launch

def rel_err(a, e):
    return ((a.double() - e).abs().max() / e.abs().max()).item()

results = {}
for name, case in json.loads(sys.argv[1]).items():
    torch.manual_seed(0)
    (n, c, h, w, r, stride, padding, dilation, ops, kinds, outputs, layout, tile, wide) = case
    depthwise.WIDE_OFFSETS = 0 if wide else 2 ** 31  # 64-bit offsets, as for huge tensors
    x = torch.randn(n, c, h, w).half()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(c, 1, r, r) / r).half()
    ho = (h + 2 * padding - dilation * (r - 1) - 1) // stride + 1
    wo = (w + 2 * padding - dilation * (r - 1) - 1) // stride + 1
    shapes = [(1,), (1, c, 1, 1), (n, c, ho, wo)]
    operands = [torch.rand(shapes[kind]).add(0.5).half() for kind in kinds]
    pair = lambda v: (v, v)
    program = ConvProgram(0, 1, pair(stride), pair(padding), pair(dilation),
                          tuple(range(len(kinds))), tuple(kinds), tuple(ops), tuple(outputs))
    config = TileConfig(**tile) if tile else None
    got = launch(depthwise_triton, x, weight, operands, program, config)
    want = depthwise_reference(x.double(), weight.double(), [o.double() for o in operands],
                               program)
    results[name] = [[list(g.shape) == list(e.shape), g.dtype == torch.float16,
                      g.is_contiguous(memory_format=torch.channels_last), rel_err(g, e)]
                     for g, e in zip(got, want)]
print(json.dumps(results))
"""

SMALL = {"bm": 32, "bn": 16, "bk": 1}
CASES = {
    # name: (N, C, H, W, R, stride, padding, dilation, ops, kinds, outputs, input layout,
    #        tile configuration or None for the default one, 64-bit offsets)
    "3x3, batch norm, ReLU6 (MobileNetV2)": (
        2, 24, 9, 7, 3, 1, 1, 1, (MUL, ADD, CLAMP), (CHANNEL, CHANNEL, SCALAR), (3,), "nchw",
        SMALL, False),
    "5x5/s2, batch norm, SiLU, two outputs (EfficientNet)": (
        1, 40, 8, 8, 5, 2, 2, 1, (MUL, ADD, SILU), (CHANNEL, CHANNEL), (0, 3), "channels_last",
        None, False),
    "3x3 dilated, residual, ragged channels": (
        2, 20, 6, 6, 3, 1, 2, 2, (ADD, RELU), (FULL,), (2,), "channels_last",
        {**SMALL, "bn": 8}, False),
    "7x7, every other op": (
        1, 16, 9, 9, 7, 1, 3, 1, (SUB, DIV, TANH, SIGMOID), (SCALAR, CHANNEL), (4,), "nchw",
        None, False),
    "64-bit offsets, channels the tile divides": (
        2, 32, 7, 7, 3, 2, 1, 1, (MUL, ADD, CLAMP), (CHANNEL, FULL, SCALAR), (0, 3),
        "channels_last", SMALL, True),
    "64-bit offsets, ragged channels": (
        1, 24, 6, 5, 3, 1, 1, 1, (ADD, SILU), (CHANNEL,), (2,), "nchw", SMALL, True),
}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every case of :data:`CASES` run in one new process under Triton's interpreter: per case
    and output, [shape right, fp16, channels_last, error against fp64]."""
    return run_interpreted(_SCRIPT, CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_matches_fp64(case, interpreted):
    outputs = interpreted[case]
    assert len(outputs) == len(CASES[case][10])
    for shape_ok, fp16, channels_last, err in outputs:
        assert shape_ok and fp16 and channels_last
        assert err < 2e-3, (case, err)


def test_configurations():
    """The default first, no duplicates, channel tiles within the channel count's power of two
    (at least 8), 4096 outputs per default program."""
    assert default_config(32 * 112 * 112, 32) == default_config(401408, 32)
    assert (default_config(401408, 32).bm, default_config(401408, 32).bn) == (128, 32)
    assert (default_config(1568, 960).bm, default_config(1568, 960).bn) == (64, 64)
    for m, c in ((401408, 32), (1568, 960), (50, 12), (6272, 144)):
        configs = candidate_configs(m, c)
        assert configs[0] == default_config(m, c) and len(set(configs)) == len(configs) >= 2
        for config in configs:
            assert 8 <= config.bn <= max(8, 1 << (c - 1).bit_length()) and config.bm >= 32


class _Block(nn.Module):
    """MobileNetV2's depthwise layer: a 3x3 convolution with one group per channel, batch norm,
    ReLU6."""

    def __init__(self, c: int = 16, stride: int = 1, act: type = nn.ReLU6):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = act()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _bf16(model, x, **options):
    return specialize(model.to(torch.bfloat16).eval(), x.to(torch.bfloat16), **options)


def test_the_kernel_takes_depthwise_regions_with_their_epilogue():
    spec = _bf16(_Block(), torch.randn(2, 16, 8, 8))
    program = depthwise_program(spec.regions[0], torch.device("cpu"))
    assert not isinstance(program, str), program
    assert program.ops == (MUL, ADD, CLAMP) and program.kinds == (CHANNEL, CHANNEL, SCALAR)
    assert program.operands[-1].item() == 6.0  # ReLU6's bound
    # the implicit-GEMM kernel does not take it, and the depthwise kernel no other convolution
    assert "grouped" in conv_program(spec.regions[0], torch.device("cpu"))
    for model in (nn.Sequential(nn.Conv2d(16, 16, 3)), nn.Sequential(nn.Conv2d(16, 32, 3,
                                                                               groups=16)),
                  nn.Sequential(nn.Conv2d(16, 16, 3, groups=4))):
        spec = _bf16(model, torch.randn(1, 16, 8, 8))
        assert "not a depthwise convolution" in depthwise_program(spec.regions[0],
                                                                  torch.device("cpu"))


def test_among_the_defaults_and_declined_silently_without_cuda():
    """In the default backends; where it cannot run (no CUDA) or the region is not depthwise,
    it gives no reason (a region's reason stays cuDNN's)."""
    assert "triton_depthwise" in DEFAULT_BACKENDS
    assert DEFAULT_BACKENDS.index("triton_depthwise") < DEFAULT_BACKENDS.index("cudnn")
    spec = _bf16(_Block(), torch.randn(2, 16, 8, 8))
    support = triton_depthwise.TritonDepthwiseBackend().supports(spec.regions[0])
    assert not support and not support.reason


@pytest.mark.parametrize("act", [nn.ReLU6, nn.SiLU])
def test_compile_runs_depthwise_regions_on_the_kernel(act, monkeypatch):
    """With the backend's CUDA check lifted, the default backends give the depthwise region a
    :class:`~fusion_compiler.kernels.depthwise.DepthwiseKernel` (its torch-ops path on the
    CPU; cuDNN does not load here): outputs as eager's. In training it is declined."""
    monkeypatch.setattr(triton_depthwise, "triton_reason", lambda: "")
    torch.manual_seed(0)
    model = _Block(act=act).to(torch.bfloat16).eval()
    x = torch.randn(2, 16, 12, 12, dtype=torch.bfloat16)
    compiled = CompiledModule(model, options=CUDA_PIPELINE)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert rel_err(got.float(), want.float()) < 2e-2
    region = compiled.last.regions[0]
    assert region.backend == "triton_depthwise" and "depthwise convolution" in region.plan
    model.train()
    compiled = CompiledModule(model, options=CUDA_PIPELINE)
    compiled(x.requires_grad_()).float().sum().backward()
    assert compiled.last.regions[0].backend != "triton_depthwise"
