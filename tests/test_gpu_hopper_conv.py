"""The Hopper convolution (backend ``hopper_conv``) on a Hopper GPU: the Gluon kernel against fp64
on SE-ResNet9's and ResNet-50's layer shapes (stride 1 and 2) and ragged ones, fp16 and bf16,
with their epilogues and every candidate tile; a channel-slice input (horizontal fusion's
views); and ``compile`` asking it beside cuDNN on SE-ResNet9, timing both per region and running
the faster.
All tests carry ``@pytest.mark.gpu`` and skip without a GPU of compute capability 9.0.
tests/test_hopper_conv.py covers the rest on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import needs_triton_kernel, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.kernels.conv import CHANNEL, FULL, SCALAR, ConvProgram, conv_reference
from fusion_compiler.kernels.epilogue import ADD, MUL, RELU, SIGMOID, SILU, TANH

pytestmark = pytest.mark.gpu

_needs_gluon = needs_triton_kernel("fusion_compiler.kernels.conv_hopper", "gluon_kernel",
                                   "Hopper convolution")


@pytest.fixture(autouse=True)
def _needs_hopper() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a GPU of compute capability 9.0 (Hopper)")


SHAPES = {  # N, C, H, W, K, R, padding, stride
    "SE-ResNet9 layer0, 16x16, 64 channels": (8, 64, 16, 16, 64, 3, 1, 1),
    "SE-ResNet9 layer3, 2x2, 512 channels": (32, 512, 2, 2, 512, 3, 1, 1),
    "ResNet-50 1x1, 7x7, 512 -> 2048": (4, 512, 7, 7, 2048, 1, 0, 1),
    "ragged: 48 -> 40 channels, 9x11, no padding": (3, 48, 9, 11, 40, 3, 0, 1),
    "SE-ResNet9 layer1's first, 16x16 -> 8x8, 64 -> 256": (8, 64, 16, 16, 256, 3, 1, 2),
    "ResNet-50 downsample 1x1/s2, 28x28 -> 14x14": (4, 256, 28, 28, 512, 1, 0, 2),
    "stride 2, 5x5, no padding, 10x12 -> 3x4": (3, 32, 10, 12, 48, 5, 0, 2),
}
EPILOGUES = {  # ops, operand kinds, outputs
    "conv": ((), (), (0,)),
    "bias_relu": ((ADD, RELU), (CHANNEL,), (2,)),
    "fixup_tail": ((MUL, ADD, ADD, RELU), (CHANNEL, CHANNEL, FULL), (4,)),
    "bias_silu_two_outputs": ((ADD, SILU), (CHANNEL,), (1, 2)),
    "scalar_sigmoid_tanh": ((MUL, SIGMOID, TANH), (SCALAR,), (3,)),
}


def _case(shape: str, epilogue: str, dtype: torch.dtype, strided: bool = False):
    n, c, h, w, k, r, pad, stride = SHAPES[shape]
    ops, kinds, outputs = EPILOGUES[epilogue]
    torch.manual_seed(0)
    if strided:  # the second half of a wider image's channels, as horizontal fusion's views
        x = torch.randn(n, 2 * c, h, w, device="cuda", dtype=dtype).contiguous(
            memory_format=torch.channels_last)[:, c:]
    else:
        x = torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(
            memory_format=torch.channels_last)
    weight = (torch.randn(k, c, r, r, device="cuda") / (r * c ** 0.5)).to(dtype)
    ho, wo = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    shapes = {SCALAR: (1,), CHANNEL: (1, k, 1, 1), FULL: (n, k, ho, wo)}
    operands = [(torch.rand(shapes[kind], device="cuda") + 0.5).to(dtype) for kind in kinds]
    program = ConvProgram(0, 1, (stride, stride), (pad, pad), (1, 1), tuple(range(len(kinds))),
                          kinds, ops, outputs)
    want = conv_reference(x.double(), weight.double(), [o.double() for o in operands], program)
    return x, weight.contiguous(memory_format=torch.channels_last), operands, program, want, (
        n, k, ho, wo)


def _check(got, want, shape, dtype):
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert len(got) == len(want)
    for g, wv in zip(got, want):
        assert g.dtype == dtype and g.shape == shape
        assert g.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(g, wv) < tol


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_fp64(shape, epilogue, dtype):
    from fusion_compiler.kernels.conv_hopper import gluon_kernel, launch

    x, weight, operands, program, want, out_shape = _case(shape, epilogue, dtype)
    _check(launch(gluon_kernel(), x, weight, operands, program), want, out_shape, dtype)


@pytest.mark.parametrize("shape", ["SE-ResNet9 layer0, 16x16, 64 channels",
                                   "ragged: 48 -> 40 channels, 9x11, no padding",
                                   "stride 2, 5x5, no padding, 10x12 -> 3x4"])
def test_every_candidate_tile_matches_fp64(shape):
    from fusion_compiler.kernels.conv_hopper import candidate_configs, gluon_kernel, launch

    x, weight, operands, program, want, (n, k, ho, wo) = _case(shape, "fixup_tail",
                                                               torch.float16)
    for config in candidate_configs(n * ho * wo, k, x.shape[1]):
        got = launch(gluon_kernel(), x, weight, operands, program, config)
        _check(got, want, (n, k, ho, wo), torch.float16)


@pytest.mark.parametrize("shape", ["SE-ResNet9 layer0, 16x16, 64 channels",
                                   "SE-ResNet9 layer1's first, 16x16 -> 8x8, 64 -> 256"])
def test_a_channel_slice_of_a_wider_image(shape):
    """Read in place at stride 1; at stride 2 (its pixels are not 2 * C apart) copied first."""
    from fusion_compiler.kernels.conv_hopper import gluon_kernel, launch

    x, weight, operands, program, want, out_shape = _case(shape, "bias_relu", torch.float16,
                                                          strided=True)
    assert not x.is_contiguous(memory_format=torch.channels_last) and x.stride(1) == 1
    _check(launch(gluon_kernel(), x, weight, operands, program), want, out_shape, torch.float16)


def test_compile_times_it_against_cudnn_and_runs_the_faster():
    """SE-ResNet9 (RGB, N=32, fp16) compiled asking ``hopper_conv`` beside cuDNN (CUDA graphs,
    autotuned): within fp16's tolerance of fp64; some region's Hopper kernel was timed against
    cuDNN's plan, and a region runs the Hopper kernel only where it timed
    faster (its plan then names it)."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=3).cuda().half().eval()
    x = torch.randn(32, 3, 64, 64, device="cuda").half()
    compiled = fc.compile(model, cache_dir=False, backends=(
        "triton_stem", "dense", "triton_depthwise", "hopper_conv", "cudnn"))
    with torch.inference_mode():
        compiled.specialize(x)
        compiled.wait_for_background_compiles()  # the last tier: the regions' chosen kernels
        got = compiled(x)
        got = compiled(x)  # a replay of the captured graph
    ref = copy.deepcopy(model).double().cpu()
    with torch.no_grad():
        want = ref(x.double().cpu())
    assert rel_err(got.float().cpu(), want) < 2e-3
    timed = [r for r in compiled.last.regions if "hopper_conv" in r.timing]
    assert timed, [(r.region_id, r.pattern, r.backend, dict(r.timing))
                   for r in compiled.last.regions]
    for r in timed:
        by_backend = {b: ms for b, ms in r.timing.items() if " " not in b}  # not tile timings
        best = min(by_backend.values())
        assert r.timing[r.backend] == best, (r.region_id, r.backend, dict(r.timing))
        if r.backend == "hopper_conv":
            assert "wgmma" in r.plan
