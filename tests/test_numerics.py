"""Compiled output equals eager (reference backend on the CPU) for the reference networks, the
exact rewrites, re-specialization and input checks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import CUDA_PIPELINE, rel_err

import fusion_compiler as fc
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.tables import pytorch_nodes
from examples.seresnet9_fixup import (SEFixupBlock, SpaceToDepth, bps_visual_encoder, randomize_,
                                      se_resnet9_fixup)


@pytest.mark.parametrize("factory, channels", [(se_resnet9_fixup, 3), (se_resnet9_fixup, 11),
                                               (bps_visual_encoder, 3)])
def test_reference_network_matches_eager_fp32(factory, channels):
    model = randomize_(factory(channels), seed=channels).eval()
    assert all(p.abs().sum() > 0 for p in model.parameters())  # no zero conv2 / Fixup scalars
    compiled = fc.compile(model)
    x = torch.randn(4, channels, 64, 64)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert got.shape == want.shape
    assert got.is_contiguous() and want.is_contiguous()  # the memory format eager returns
    assert rel_err(got, want) < 1e-5
    regions = compiled.last.regions
    assert len(regions) == (12 if factory is se_resnet9_fixup else 13)


def test_reference_network_parameter_count():
    assert sum(p.numel() for p in se_resnet9_fixup(3).parameters()) == 4_938_256
    assert se_resnet9_fixup(3)(torch.randn(1, 3, 64, 64)).shape == (1, 512, 2, 2)


@pytest.mark.parametrize("channels, pattern", [(3, "conv1x1"), (8, "conv4x4/s4")])
def test_space_to_depth_rewrite_is_exact_in_fp64(channels, pattern):
    """3 channels: a channels_last SpaceToDepth copy feeds the 1x1 conv (cuDNN would pad a folded
    conv's image to 8 channels); 8 channels: folded into one 4x4 stride-4 conv."""
    model = nn.Sequential(SpaceToDepth(4), nn.Conv2d(16 * channels, 16, 1, bias=False)).double()
    x = torch.randn(2, channels, 32, 32, dtype=torch.float64)
    compiled = CompiledModule(model, options=CUDA_PIPELINE)  # the rewrite runs for CUDA only
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-12
    region = compiled.last.regions[0]
    assert region.pattern == pattern
    if channels == 3:
        assert region.conv.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("channels, kernel, stride, padding, size", [
    (3, 4, 4, 0, (32, 32)),  # ConvNeXt's patchify stem
    (3, 4, 4, 1, (33, 30)),  # padded, odd sizes (the pad crops the last rows)
    (1, 4, 4, 0, (20, 24)),  # a grey image
    (3, 2, 2, 0, (20, 22)),  # a zero fourth channel makes 16
])
def test_strided_stem_rewrite_is_exact_in_fp64(channels, kernel, stride, padding, size):
    """A patchify convolution of a few-channel image becomes a 1x1 convolution of its
    space-to-depth copy: the same values, and in training the same gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(channels, 16, kernel, stride, padding), nn.BatchNorm2d(16),
                          nn.ReLU()).double()
    x = torch.randn(2, channels, *size, dtype=torch.float64)
    compiled = CompiledModule(copy.deepcopy(model).eval(), options=CUDA_PIPELINE)
    with torch.no_grad():
        assert rel_err(compiled(x), model.eval()(x)) < 1e-12
    assert compiled.last.regions[0].pattern.startswith("conv1x1 ")
    trained, eager = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    compiled = CompiledModule(trained, options=CUDA_PIPELINE)
    compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    for (name, got), want in zip(trained.named_parameters(), eager.parameters()):
        # atol: the conv bias's gradient is zero but for rounding (batch norm subtracts the mean)
        assert torch.allclose(got.grad, want.grad, rtol=1e-9, atol=1e-11), name


@pytest.mark.parametrize("channels, kernel, stride, padding", [
    (3, 7, 2, 3), (3, 3, 2, 1),  # ResNet's, MobileNet's: 4x4 and 2x2 convolutions, slower
    (3, 2, 4, 0),  # a kernel smaller than its stride reads part of the image
    (3, 3, 3, 0), (1, 2, 2, 0),  # odd stride, one channel: padded to 8 (24, 2) channels
])
def test_other_strided_stems_are_kept(channels, kernel, stride, padding):
    """Strided stems the space-to-depth form does not take (``strided_stem_conv``)."""
    model = nn.Sequential(nn.Conv2d(channels, 16, kernel, stride, padding),
                          nn.ReLU()).double().eval()
    compiled = CompiledModule(model, options=CUDA_PIPELINE)
    with torch.no_grad():
        compiled(torch.randn(2, channels, 16, 16, dtype=torch.float64))
    assert compiled.last.regions[0].pattern.startswith(f"conv{kernel}x{kernel}/s{stride}")


def test_avgpool_conv_rewrite_is_exact_in_fp64():
    model = nn.Sequential(nn.AvgPool2d(3, 2, padding=1), nn.Conv2d(8, 16, 1, bias=False)).double()
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    compiled = CompiledModule(model, options=CUDA_PIPELINE)  # the rewrite runs for CUDA only
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-12
    assert compiled.last.regions[0].pattern == "conv3x3/s2"


@pytest.mark.parametrize("pool, pattern", [(nn.AvgPool2d(2, 2), "conv2x2/s2"),
                                           (nn.AvgPool2d(3, 2, padding=1), "conv3x3/s2")])
def test_a_pool_after_a_1x1_conv_is_one_conv_exact_in_fp64(pool, pattern):
    """DenseNet's transition (BN, ReLU, 1x1 convolution, 2x2 average pool): the pool and the
    convolution one convolution (``avgpool_conv``), the same values but for rounding."""
    model = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 1, bias=False),
                          pool).double().eval()
    x = torch.randn(2, 8, 9, 9, dtype=torch.float64)
    compiled = CompiledModule(model, options=CUDA_PIPELINE)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-12
    assert [r.pattern for r in compiled.last.regions] == [pattern]
    left = [p["op"] for p in pytorch_nodes(compiled.last.graph_module)]
    assert "avg_pool2d" not in left and "AvgPool2d" not in left, left


def test_a_pool_after_a_1x1_conv_with_another_reader_or_a_bias_stays():
    class TwoReaders(nn.Module):
        def __init__(self, bias: bool):
            super().__init__()
            self.conv = nn.Conv2d(8, 16, 1, bias=bias)
            self.bias = bias

        def forward(self, x):
            y = self.conv(x)
            pooled = F.avg_pool2d(y, 2)
            return pooled if self.bias else (pooled, y)

    for bias in (False, True):
        compiled = CompiledModule(TwoReaders(bias).eval(), options=CUDA_PIPELINE)
        with torch.no_grad():
            compiled(torch.randn(2, 8, 8, 8))
        assert [r.pattern for r in compiled.last.regions] == [
            "conv1x1 > add" if bias else "conv1x1"]


def test_new_input_shape_respecializes():
    model = randomize_(se_resnet9_fixup(3)).eval()
    compiled = fc.compile(model, [torch.randn(2, 3, 64, 64)])
    with torch.no_grad():
        for n in (2, 5, 2):
            x = torch.randn(n, 3, 64, 64)
            assert rel_err(compiled(x), model(x)) < 1e-5
    assert len(compiled.specializations) == 2 + 1  # the eager one (grad on) and two batch sizes


def test_gradients_through_reference_backend_match_eager():
    model = randomize_(SEFixupBlock(16, 32, stride=2, reduction=4))
    twin = copy.deepcopy(model)
    compiled = fc.compile(twin)
    x = torch.randn(3, 16, 8, 8)
    model(x).square().mean().backward()
    compiled(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-5, name


def test_wrong_inputs_raise_clear_errors():
    compiled = fc.compile(nn.Conv2d(3, 8, 3))
    with pytest.raises(TypeError, match=r"Conv2d takes 1 input \(input\), got 2"):
        compiled(torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="cannot take input 0 1x3x8x8:float16@cpu: Input type"):
        compiled(torch.randn(1, 3, 8, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="backends: no backend named 'tensorrt'"):
        fc.compile(nn.Conv2d(3, 8, 3), backends=("tensorrt", "cudnn"))


def test_untraceable_model_raises_fusion_error():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(fc.FusionError, match="symbolic_trace failed"):
        fc.compile(DataDependent())
