"""The Triton implicit-GEMM convolution (backend ``triton_conv``) on the GPU: the compiled kernel
against fp64 (SE-ResNet9's layer shapes and odd ones, fp16 and bf16, every epilogue kind), and
``compile(model, backends=(..., "triton_conv", ...))`` timing it against cuDNN per region. All tests
carry ``@pytest.mark.gpu`` (and skip without Triton). tests/test_triton_conv.py runs the kernel
under Triton's interpreter on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import WITH_TRITON_CONV, needs_triton_kernel, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomized_se_resnet9_fixup
from fusion_compiler.kernels.epilogue import ADD, DIV, MUL, RELU, SIGMOID, SILU, SUB, TANH
from fusion_compiler.kernels.conv import CHANNEL, FULL, SCALAR

pytestmark = pytest.mark.gpu


_needs_triton = needs_triton_kernel("fusion_compiler.kernels.conv", "triton_kernel",
                                    "conv_nhwc")


SHAPES = {  # N, C, H, W, K, R, stride, padding
    "layer0 3x3": (128, 64, 16, 16, 64, 3, 1, 1),
    "layer1 3x3/s2": (128, 64, 16, 16, 128, 3, 2, 1),
    "layer3 3x3 (small M)": (128, 512, 2, 2, 512, 3, 1, 1),
    "1x1": (64, 256, 8, 8, 128, 1, 1, 0),
    "ragged channels": (3, 20, 9, 11, 36, 3, 1, 1),
    "5x5/s2": (8, 32, 17, 17, 48, 5, 2, 2),
}
EPILOGUES = {  # ops, operand kinds, outputs
    "conv": ((), (), (0,)),
    "bias_relu_bias": ((ADD, RELU, ADD), (SCALAR, SCALAR), (3,)),
    "scale_residual_silu_two_outputs": ((MUL, ADD, SILU), (CHANNEL, FULL), (2, 3)),
    "all_ops": ((SUB, DIV, TANH, SIGMOID, RELU), (CHANNEL, SCALAR), (5,)),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
def test_kernel_matches_fp64(shape, dtype, epilogue, layout):
    from fusion_compiler.kernels.conv import ConvProgram, conv_reference, launch, triton_kernel

    n, c, h, w, k, r, stride, padding = SHAPES[shape]
    ops, kinds, outputs = EPILOGUES[epilogue]
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(k, c, r, r, device="cuda") / (c * r * r) ** 0.5).to(dtype)
    ho, wo = (h + 2 * padding - r) // stride + 1, (w + 2 * padding - r) // stride + 1
    shapes = {SCALAR: (1,), CHANNEL: (1, k, 1, 1), FULL: (n, k, ho, wo)}
    operands = [(torch.rand(shapes[kind], device="cuda") + 0.5).to(dtype) for kind in kinds]
    program = ConvProgram(0, 1, (stride, stride), (padding, padding), (1, 1),
                          tuple(range(len(kinds))), kinds, ops, outputs)
    got = launch(triton_kernel(), x, weight, operands, program)
    want = conv_reference(x.double(), weight.double(), [o.double() for o in operands], program)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for g, wv in zip(got, want):
        assert g.dtype == dtype and g.shape == (n, k, ho, wo)
        assert g.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(g, wv) < tol


@pytest.mark.parametrize("config", ["default", "128x128x32", "split2", "split4"])
def test_every_candidate_kind_matches_fp64(config):
    """SE-ResNet9's layer3 at N=128 (32 tiles of 64x128: the shape split-K is for) with a
    residual and two outputs, under each kind of configuration autotuning times."""
    from fusion_compiler.kernels.conv import (ConvProgram, TileConfig, conv_reference, launch,
                                              triton_kernel)

    configs = {"default": None, "128x128x32": TileConfig(128, 128, 32, warps=8, stages=4),
               "split2": TileConfig(64, 128, 64, stages=4, split=2),
               "split4": TileConfig(64, 128, 64, stages=4, split=4)}
    torch.manual_seed(0)
    x = torch.randn(128, 256, 4, 4, device="cuda", dtype=torch.half)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(512, 256, 3, 3, device="cuda") / 48).half()
    residual = torch.randn(128, 512, 2, 2, device="cuda", dtype=torch.half)
    program = ConvProgram(0, 1, (2, 2), (1, 1), (1, 1), (0, 1), (SCALAR, FULL),
                          (ADD, RELU, ADD), (0, 3))
    operands = [torch.tensor([0.25], device="cuda"), residual]
    got = launch(triton_kernel(), x, weight, operands, program, configs[config])
    want = conv_reference(x.double(), weight.double(), [o.double() for o in operands], program)
    for g, wv in zip(got, want):
        assert rel_err(g, wv) < 2e-3


def test_compile_times_the_kernel_against_cudnn_per_region(tmp_path):
    """SE-ResNet9 RGB at N=128 with the ``triton_conv`` backend: every region but the stem has both
    candidates' times in its record and runs the faster; outputs within fp16 tolerance of fp64,
    in a CUDA-graph replay whose kernels include the chosen ones."""
    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup().cuda().half().eval()
    x = torch.randn(128, 3, 64, 64, device="cuda", dtype=torch.half)
    want = copy.deepcopy(model).double()(x.double())
    compiled = fc.compile(model, backends=WITH_TRITON_CONV, cache_dir=tmp_path)
    with torch.inference_mode():
        compiled(x)
        compiled.wait_for_background_compiles()
        got = compiled(x)
    assert rel_err(got, want) < 2e-3
    regions = [r for r in compiled.last.regions if not r.space_to_depth]
    assert len(regions) == 8  # 11 convolutions, 6 merged in pairs (horizontal fusion)
    for region in regions:
        assert {"triton_conv", "cudnn"} <= set(region.timing), (region.region_id,
                                                                 region.timing)
        # dense: layer3's 2x2 images
        taking = {"triton_conv", "cudnn", "dense"} & set(region.timing)
        fastest = min(taking, key=region.timing.__getitem__)
        assert region.backend == fastest, (region.region_id, region.timing)
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    if any(r.backend == "triton_conv" for r in regions):
        assert any("conv_nhwc_kernel" in name for name in names)
    if any(r.backend == "cudnn" for r in regions):
        assert any("convFwd" in name for name in names)
    # the tile configurations are in the plan cache: a new compile times none of them
    assert list(tmp_path.glob("*.triton_conv.json"))
    again = fc.compile(copy.deepcopy(model), backends=WITH_TRITON_CONV, cache_dir=tmp_path)
    with torch.inference_mode():
        again(x)
        again.wait_for_background_compiles()
    for region in again.last.regions:
        assert not [name for name in region.timing if name.startswith("triton ")], region.timing


def test_training_runs_the_forward_on_the_kernel(monkeypatch):
    """In training the kernel runs a region's forward, writing the values its backward reads, and
    the backward is the cuDNN backend's. cuDNN's forward wins every SE-ResNet9 region on an H100,
    so the lowering is made to keep the kernel wherever it runs: fp16 gradients are then within
    the bounds the cuDNN path meets against fp64 (tests/test_gpu_training.py), and a training
    step runs the kernel and cuDNN's gradient kernels."""
    from test_gpu_training import _check_cudnn_gradients

    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler import lowering

    chosen = lowering._fastest
    monkeypatch.setattr(lowering, "_fastest", lambda region, lowered, cache: (
        ("triton_conv", {}) if "triton_conv" in lowered else chosen(region, lowered, cache)))
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=3).train()
    compiled = _check_cudnn_gradients(model, torch.randn(32, 3, 64, 64), input_grad=False,
                                      backend="triton_conv", backends=WITH_TRITON_CONV)
    assert all(p.backend == "cudnn" for r in compiled.last.regions for p in r.gradients
               if "not needed" not in p.reason), [r.gradients for r in compiled.last.regions]
    x = torch.randn(32, 3, 64, 64, device="cuda", dtype=torch.half)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x).float().sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("conv_nhwc_kernel" in name for name in names)
    assert any("dgrad" in name.lower() for name in names), sorted(set(names))
