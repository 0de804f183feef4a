"""The Hopper convolution (backend ``hopper_conv``) on the CPU: which regions its kernel takes,
its tile shapes, the backend's declines, and a compile that gives it regions (its torch-ops
path here). The kernel itself is Gluon for sm_90a and runs only on a Hopper GPU:
tests/test_gpu_hopper_conv.py compares it with fp64 there."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_compiler.backends import hopper_conv, registered
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.config import CompileOptions, DEFAULT_BACKENDS
from fusion_compiler.kernels.conv import CHANNEL, FULL
from fusion_compiler.kernels.conv_hopper import (candidate_configs, default_config,
                                                 hopper_program, pixel_box)
from fusion_compiler.kernels.epilogue import ADD, MUL, RELU
from conftest import CUDA_PIPELINE, rel_err, specialize

WITH_HOPPER = ("triton_stem", "dense", "triton_depthwise", "hopper_conv", "cudnn")


class _Residual(nn.Module):
    """``relu(conv(x) * scale + bias + x)``: a Fixup block's tail, one region."""

    def __init__(self, c: int = 32, k: int = 32, kernel: int = 3, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c, k, kernel, stride, kernel // 2, bias=False)
        self.scale = nn.Parameter(torch.rand(1, k, 1, 1) + 0.5)
        self.bias = nn.Parameter(torch.randn(1, k, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x) * self.scale + self.bias + x)


def _half(model: nn.Module, x: torch.Tensor, dtype=torch.float16):
    return specialize(model.to(dtype).eval(), x.to(dtype))


def test_the_kernel_takes_stride_one_regions_with_their_epilogue():
    spec = _half(_Residual(), torch.randn(2, 32, 8, 8))
    program = hopper_program(spec.regions[0], torch.device("cpu"))
    assert not isinstance(program, str), program
    assert program.ops == (MUL, ADD, ADD, RELU) and program.kinds == (CHANNEL, CHANNEL, FULL)
    assert program.padding == (1, 1)


def _conv_relu(c: int, stride: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(c, 32, 3, stride, 1), nn.ReLU())


def test_stride_two_on_an_even_image_is_taken():
    spec = _half(_conv_relu(32, 2), torch.randn(2, 32, 16, 16))
    program = hopper_program(spec.regions[0], torch.device("cpu"))
    assert not isinstance(program, str), program
    assert program.stride == (2, 2) and program.ops == (ADD, RELU)


@pytest.mark.parametrize("model, shape, dtype, why", [
    (_conv_relu(32, 2), (2, 32, 9, 9), torch.float16, "stride 2 on a 9x9 image"),
    (_conv_relu(32, 3), (2, 32, 9, 9), torch.float16, "stride (3, 3)"),
    (_conv_relu(24), (2, 24, 8, 8), torch.float16, "24 input channels"),
    (_conv_relu(32), (2, 32, 8, 8), torch.float32, "float32"),
])
def test_declines_with_a_reason(model, shape, dtype, why):
    spec = _half(model, torch.randn(shape), dtype)
    assert why in hopper_program(spec.regions[0], torch.device("cpu"))


@pytest.mark.parametrize("bm, n, ho, wo, box", [
    (64, 128, 16, 16, (1, 4, 16)), (128, 128, 16, 16, (1, 8, 16)), (64, 128, 8, 8, (1, 8, 8)),
    (64, 128, 4, 4, (4, 4, 4)), (64, 128, 2, 2, (16, 2, 2)), (64, 32, 7, 7, (1, 8, 8)),
    (128, 32, 56, 56, (1, 2, 64)), (64, 32, 1, 1, (64, 1, 1))])
def test_a_tile_is_a_box_of_images_rows_and_columns(bm, n, ho, wo, box):
    assert pixel_box(bm, n, ho, wo) == box
    images, rows, cols = box
    assert images * rows * cols == bm


@pytest.mark.parametrize("m, k, c", [(32768, 64, 64), (8192, 128, 128), (512, 512, 512),
                                     (1568, 2048, 512), (100, 8, 16), (4096, 96, 48)])
def test_configurations_fit_the_shape(m, k, c):
    configs = candidate_configs(m, k, c)
    assert configs[0] == default_config(m, k, c) and len(set(configs)) == len(configs)
    for config in configs:
        assert c % config.bk == 0 and config.bm in (64, 128) and 16 <= config.bn <= 128
        assert config.warps == (8 if config.bm * config.bn >= 128 * 128 else 4)


def test_registered_not_a_default_and_declined_silently_without_a_hopper_gpu():
    """Registered, not among the defaults (docs/decisions.md, "Hopper convolutions"); where it
    cannot run (no CUDA here) it gives no reason: a region's reason stays cuDNN's."""
    assert "hopper_conv" in [r.name for r in registered()]
    assert "hopper_conv" not in DEFAULT_BACKENDS
    CompileOptions(backends=WITH_HOPPER)  # a valid option
    spec = _half(_Residual(), torch.randn(2, 32, 8, 8))
    support = hopper_conv.HopperConvBackend().supports(spec.regions[0])
    assert not support and not support.reason


def test_compile_runs_regions_on_the_kernel_and_declines_training(monkeypatch):
    """With the backend's GPU check lifted, a compile asking it gives the region a
    :class:`~fusion_compiler.kernels.conv_hopper.HopperConvKernel` (its torch-ops path on the
    CPU; cuDNN does not load here): outputs as eager's. In training it is declined."""
    monkeypatch.setattr(hopper_conv, "hopper_reason", lambda: "")
    torch.manual_seed(0)
    model = _Residual().to(torch.bfloat16).eval()
    x = torch.randn(2, 32, 12, 12, dtype=torch.bfloat16)
    compiled = CompiledModule(model, CUDA_PIPELINE, backends=WITH_HOPPER)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert rel_err(got.float(), want.float()) < 2e-2
    region = compiled.last.regions[0]
    assert region.backend == "hopper_conv" and "wgmma" in region.plan
    model.train()
    compiled = CompiledModule(model, CUDA_PIPELINE, backends=WITH_HOPPER)
    compiled(x.requires_grad_()).float().sum().backward()
    assert compiled.last.regions[0].backend != "hopper_conv"
