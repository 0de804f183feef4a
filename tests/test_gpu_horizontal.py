"""Horizontal fusion on the GPU: SE-ResNet9's three pairs of sibling convolutions run as one cuDNN
convolution each, the readers of its channel views (cuDNN regions and the ``se_scale`` kernel)
read them in place (the dense GEMM copies its view: one copy kernel), and outputs match fp32
within 1.5x of eager's error, through ``compile(model)`` and ``torch.compile``.
tests/test_fuse_patterns.py covers the rewrite on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import lowered_or_pytorch_faster, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomized_se_resnet9_fixup
from fusion_compiler.dynamo import fusion_compiler_backend, wait_for_background_compiles
from fusion_compiler.kernels.dense_conv import DenseConvKernel, DenseProgram
from fusion_compiler.kernels.conv import ConvProgram, conv_reference

pytestmark = pytest.mark.gpu


def _kernels(compiled, x) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("n", [8, 128])
def test_se_resnet9_reads_the_merged_outputs_in_place(n):
    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup().cuda().half().eval()
    x = torch.randn(n, 3, 64, 64, device="cuda", dtype=torch.half)
    want = copy.deepcopy(model).float()(x.float())
    errors, kernels = {}, {}
    with torch.inference_mode():
        eager = rel_err(model(x).float(), want)
        for on in (True, False):
            compiled = fc.compile(model, horizontal_fusion=on, cache_dir=False)
            compiled(x)
            compiled.wait_for_background_compiles()
            errors[on] = rel_err(compiled(x).float(), want)
            kernels[on] = _kernels(compiled, x)
            if on:
                regions = compiled.last.regions
    assert len(regions) == 9 and all(r.status == "lowered" for r in regions), compiled.report()
    # layers 1-3: the first convolution (3x3/s2) and the downsample, 2K output channels
    merged = [r for r in regions if r.pattern.startswith("conv3x3/s2")]
    assert [r.conv.meta["val"].shape[1] for r in merged] == [256, 512, 1024]
    assert all(r.backend == "cudnn" and len(r.output_nodes) == 2 for r in merged)
    # three convolutions fewer, and one copy more if the dense GEMM takes layer 3's view, the same
    # other kernels
    conv, gemm = ("cudnn", "xmma"), ("nvjet", "gemm", "cublas", "splitK")
    others = {on: sorted(k for k in names if not any(c in k for c in conv + gemm))
              for on, names in kernels.items()}
    dense = sum(r.backend == "dense" for r in regions)  # cuDNN may win at N=8
    copies = [k for k in others[True] if "elementwise" in k]
    assert len(copies) == dense + sum("elementwise" in k for k in others[False]), others
    assert [k for k in others[True] if "elementwise" not in k] == \
        [k for k in others[False] if "elementwise" not in k], others
    gemms = ("cudnn", "xmma", "nvjet")  # cuDNN's convolutions and cuBLAS's GEMMs
    assert sum(any(c in k for c in gemms) for k in kernels[True]) == \
        sum(any(c in k for c in gemms) for k in kernels[False]) - 3, kernels
    assert errors[True] < 1.5 * eager and errors[False] < 1.5 * eager, (errors, eager)


def test_the_dense_gemm_takes_a_channel_view():
    """The dense kernel on 512 of 1024 channels of a channels_last tensor (it copies them to a
    packed tensor), against fp64."""
    torch.manual_seed(0)
    n, c, total, k = 16, 512, 1024, 256
    wide = torch.randn(n, total, 2, 2, device="cuda", dtype=torch.half).contiguous(
        memory_format=torch.channels_last)
    weight = (torch.randn(k, c, 3, 3, device="cuda") / (9 * c) ** 0.5).half()
    conv = ConvProgram(0, 1, (1, 1), (1, 1), (1, 1), (), (), (), (0,))
    kernel = DenseConvKernel(DenseProgram(conv, 0, False, (2, 2, c), (2, 2, k)),
                             [((n, k, 2, 2), torch.half)])
    for start in (0, c):
        x = wide.narrow(1, start, c)
        got = kernel(x, weight)[0]
        want = conv_reference(x.double(), weight.double(), [], conv)[0]
        assert rel_err(got.double(), want) < 2e-3


def test_torch_compile_door_matches():
    """The first call (tier 0: the regions as PyTorch ops while the plans build) and a call once
    the background compiles ended, with every region on a GPU kernel (or on PyTorch's ops where
    they timed faster), match."""
    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup().cuda().half().eval()
    x = torch.randn(16, 3, 64, 64, device="cuda", dtype=torch.half)
    want = copy.deepcopy(model).float()(x.float())
    seen = []

    def backend(gm, example_inputs):  # backend="fusion_compiler", keeping what it returns
        seen.append(fusion_compiler_backend(gm, example_inputs))
        return seen[-1]

    compiled = torch.compile(model, backend=backend)
    with torch.inference_mode():
        eager = rel_err(model(x).float(), want)
        assert rel_err(compiled(x).float(), want) < 1.5 * eager
        assert wait_for_background_compiles()
        assert rel_err(compiled(x).float(), want) < 1.5 * eager
    regions = seen[0].compiled_module.last.regions
    assert regions and all(lowered_or_pytorch_faster(r) for r in regions), seen[0].report()
