"""The depthwise convolution kernel (backend ``triton_depthwise``, among the defaults) on the
GPU: the compiled kernel against fp64 on MobileNetV2's and EfficientNet's layer shapes and odd
ones, fp16 and bf16, with their epilogues; ``compile(model)`` timing it against cuDNN per region
and running the one it chose. All tests carry ``@pytest.mark.gpu`` (and skip without Triton).
tests/test_depthwise.py runs the kernel under Triton's interpreter on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import needs_triton_kernel, rel_err

import fusion_compiler as fc
from fusion_compiler.kernels.epilogue import ADD, CLAMP, MUL, RELU, SILU
from fusion_compiler.kernels.conv import CHANNEL, FULL, SCALAR

pytestmark = pytest.mark.gpu


_needs_triton = needs_triton_kernel("fusion_compiler.kernels.depthwise", "triton_kernel",
                                    "depthwise")


SHAPES = {  # N, C, H, W, R, stride, padding
    "MobileNetV2 first 3x3, 112x112": (8, 32, 112, 112, 3, 1, 1),
    "3x3/s2, 112x112": (8, 96, 112, 112, 3, 2, 1),
    "3x3, 960 channels, 7x7": (32, 960, 7, 7, 3, 1, 1),
    "EfficientNet 5x5/s2": (8, 240, 28, 28, 5, 2, 2),
    "ragged channels, odd image": (3, 20, 9, 11, 3, 1, 1),
}
EPILOGUES = {  # ops, operand kinds, outputs
    "conv": ((), (), (0,)),
    "batch_norm_relu6": ((MUL, ADD, CLAMP), (CHANNEL, CHANNEL, SCALAR), (3,)),
    "batch_norm_silu_two_outputs": ((MUL, ADD, SILU), (CHANNEL, CHANNEL), (2, 3)),
    "residual_relu": ((ADD, RELU), (FULL,), (2,)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_kernel_matches_fp64(shape, dtype, epilogue):
    from fusion_compiler.kernels.conv import ConvProgram
    from fusion_compiler.kernels.depthwise import depthwise_reference, launch, triton_kernel

    n, c, h, w, r, stride, padding = SHAPES[shape]
    ops, kinds, outputs = EPILOGUES[epilogue]
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(c, 1, r, r, device="cuda") / r).to(dtype)
    ho, wo = (h + 2 * padding - r) // stride + 1, (w + 2 * padding - r) // stride + 1
    shapes = {SCALAR: (1,), CHANNEL: (1, c, 1, 1), FULL: (n, c, ho, wo)}
    operands = [(torch.rand(shapes[kind], device="cuda") + 0.5).to(dtype) for kind in kinds]
    program = ConvProgram(0, 1, (stride, stride), (padding, padding), (1, 1),
                          tuple(range(len(kinds))), kinds, ops, outputs)
    got = launch(triton_kernel(), x, weight, operands, program)
    want = depthwise_reference(x.double(), weight.double(), [o.double() for o in operands],
                               program)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for g, wv in zip(got, want):
        assert g.dtype == dtype and g.shape == (n, c, ho, wo)
        assert g.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(g, wv) < tol


class _Block(nn.Module):
    """MobileNetV2's depthwise layer: a 3x3 convolution with one group per channel, batch norm,
    ReLU6; batch-norm statistics not the initial ones."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU6()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _outputs(compiled, x):
    with torch.inference_mode():
        compiled(x)
        compiled.wait_for_background_compiles()
        return compiled(x)


@pytest.mark.parametrize("c, hw", [(576, 14), (32, 112)])
def test_compile_times_the_kernel_against_cudnn(c, hw, tmp_path):
    """``compile(model)`` with the default backends: the depthwise region has both candidates'
    times in its record and runs the faster; the output is within 1.5x eager fp16's error
    against fp32."""
    torch.manual_seed(0)
    model = _Block(c).cuda().eval()
    x = torch.randn(32, c, hw, hw, device="cuda")
    want = model(x)
    half = copy.deepcopy(model).half()
    eager = half(x.half())
    compiled = fc.compile(half, cache_dir=tmp_path)
    got = _outputs(compiled, x.half())
    record = compiled.last.regions[0]
    assert {"triton_depthwise", "cudnn"} <= set(record.timing), record.timing
    fastest = min(("triton_depthwise", "cudnn"), key=record.timing.__getitem__)
    assert record.backend == fastest, record.timing
    assert rel_err(got.float(), want) <= 1.5 * rel_err(eager.float(), want) + 1e-4


def test_the_kernel_runs_in_the_replay():
    """With ``backends=("triton_depthwise",)`` the region runs the kernel: it is in the
    profile of a CUDA-graph replay, and the output matches fp32 as eager fp16's does."""
    torch.manual_seed(0)
    model = _Block(96).cuda().eval()
    x = torch.randn(16, 96, 28, 28, device="cuda")
    want = model(x)
    half = copy.deepcopy(model).half()
    eager = half(x.half())
    compiled = fc.compile(half, backends=("triton_depthwise",))
    got = _outputs(compiled, x.half())
    assert compiled.last.regions[0].backend == "triton_depthwise", compiled.report()
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x.half())
        torch.cuda.synchronize()
    assert any("depthwise_nhwc_kernel" in e.name for e in prof.events())
    assert rel_err(got.float(), want) <= 1.5 * rel_err(eager.float(), want) + 1e-4
