"""Convolutions of small images as one dense GEMM (the ``dense`` backend) on the GPU: the kernel
against fp64 (fp16 and bf16, folded and unfolded epilogues, several geometries), and
``compile(model)`` timing it against cuDNN's plan on SE-ResNet9's small-image region, the choice
stored in the plan cache. tests/test_dense_conv.py covers the rest on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import lowered_or_pytorch_faster, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomized_se_resnet9_fixup
from fusion_compiler.kernels.conv import CHANNEL, FULL, SCALAR, ConvProgram, conv_reference
from fusion_compiler.config import DEFAULT_BACKENDS
from fusion_compiler.kernels.dense_conv import DenseConvKernel, DenseProgram, folded_ops
from fusion_compiler.kernels.epilogue import ADD, DIV, MUL, RELU, SILU, SUB, TANH

pytestmark = pytest.mark.gpu


SHAPES = {  # N, C, H, W, K, R, stride, padding
    "layer3 3x3 of 2x2": (128, 512, 2, 2, 512, 3, 1, 1),
    "3x3/s2 of 3x3": (64, 64, 3, 3, 96, 3, 2, 1),
    "5x5 of 3x3, ragged channels": (8, 20, 3, 3, 36, 5, 1, 2),
    "3x3 of 1x1": (32, 256, 1, 1, 128, 3, 1, 1),
}
EPILOGUES = {  # ops, operand kinds, outputs
    "conv": ((), (), (0,)),
    "scale_bias (SE-ResNet9's)": ((MUL, ADD), (SCALAR, SCALAR), (2,)),
    "bias_relu_bias": ((ADD, RELU, ADD), (CHANNEL, SCALAR), (3,)),
    "scale_residual_silu_two_outputs": ((MUL, ADD, SILU), (CHANNEL, FULL), (2, 3)),
    "sub_div_tanh": ((SUB, DIV, TANH), (CHANNEL, SCALAR), (3,)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_kernel_matches_fp64(shape, dtype, epilogue):
    n, c, h, w, k, r, stride, padding = SHAPES[shape]
    ops, kinds, outputs = EPILOGUES[epilogue]
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(k, c, r, r, device="cuda") / (c * r * r) ** 0.5).to(dtype)
    ho, wo = (h + 2 * padding - r) // stride + 1, (w + 2 * padding - r) // stride + 1
    shapes = {SCALAR: (1,), CHANNEL: (1, k, 1, 1), FULL: (n, k, ho, wo)}
    operands = [(torch.rand(shapes[kind], device="cuda") + 0.5).to(dtype) for kind in kinds]
    conv = ConvProgram(0, 1, (stride, stride), (padding, padding), (1, 1),
                       tuple(range(2, 2 + len(kinds))), kinds, ops, outputs)
    folded, relu = folded_ops(ops, kinds)
    program = DenseProgram(conv, folded, relu, (h, w, c), (ho, wo, k))
    kernel = DenseConvKernel(program, [((n, k, ho, wo), dtype)] * len(outputs))
    got = kernel(x, weight, *operands)
    want = conv_reference(x.double(), weight.double(), [o.double() for o in operands], conv)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for g, e in zip(got, want):
        assert g.dtype == dtype and g.shape == (n, k, ho, wo)
        assert g.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(g, e) < tol
    weight.mul_(0.5)  # an update (a new version): the dense weight is made again
    again = kernel(x, weight, *operands)[0]
    want = conv_reference(x.double(), weight.double(), [o.double() for o in operands], conv)[0]
    assert rel_err(again, want) < tol


def test_compile_times_the_dense_gemm_against_cudnn(tmp_path):
    """SE-ResNet9 RGB at N=128: layer3's 3x3 convolution of 2x2 images (the one small-image
    region) has cuDNN's and the dense GEMM's times in its record and runs the faster; outputs
    within fp16 tolerance of fp64, in a CUDA-graph replay whose kernels include the chosen one.
    A second compile on the same plan cache takes the stored choice without timing."""
    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup().cuda().half().eval()
    x = torch.randn(128, 3, 64, 64, device="cuda", dtype=torch.half)
    want = copy.deepcopy(model).double()(x.double())
    compiled = fc.compile(model, cache_dir=tmp_path)
    with torch.inference_mode():
        compiled(x)
        compiled.wait_for_background_compiles()
        got = compiled(x)
    assert rel_err(got, want) < 2e-3
    small = [r for r in compiled.last.regions if {"dense", "cudnn"} <= set(r.timing)]
    assert [r.pattern for r in small] == ["conv3x3 > mul > add"], compiled.report()
    region = small[0]
    assert region.backend == min(("dense", "cudnn"), key=region.timing.__getitem__)
    assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions), compiled.report()
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    convolutions = [n for n in names if "convFwd" in n or "fprop" in n]
    assert len(convolutions) == sum(r.backend == "cudnn" for r in compiled.last.regions), names
    again = fc.compile(copy.deepcopy(model), cache_dir=tmp_path)
    with torch.inference_mode():
        again(x)
        again.wait_for_background_compiles()
        assert rel_err(again(x), want) < 2e-3
    twin = next(r for r in again.last.regions if r.region_id == region.region_id)
    assert twin.backend == region.backend  # the stored choice and times, not timed again
    assert [twin.timing[b] for b in ("dense", "cudnn")] == [region.timing[b]
                                                            for b in ("dense", "cudnn")]


def test_no_weight_preparation_in_the_replay():
    """Convolutions with biases (operands a graph reshapes at every call) on 2x2 images: one
    replay of ``compile(model)`` launches as many GPU operations as without the ``dense`` backend
    (the dense weight and bias vector are made once, outside the graph), and matches fp64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(256, 256, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(256, 256, 3, padding=1)).cuda().half().eval()
    x = torch.randn(64, 256, 2, 2, device="cuda", dtype=torch.half)
    want = copy.deepcopy(model).double()(x.double())
    counts = {}
    for dense in (True, False):
        compiled = fc.compile(model, cache_dir=False,
                              backends=DEFAULT_BACKENDS if dense else ("triton_stem", "cudnn"))
        with torch.inference_mode():
            compiled(x)
            compiled.wait_for_background_compiles()
            assert rel_err(compiled(x), want) < 2e-3
            assert all(lowered_or_pytorch_faster(r) for r in compiled.last.regions), \
                compiled.report()
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                compiled(x)
                torch.cuda.synchronize()
        counts[dense] = sum(e.device_type.name == "CUDA" for e in prof.events())
        if dense:
            backends = [r.backend for r in compiled.last.regions]
    assert counts[True] == counts[False], (counts, backends)
