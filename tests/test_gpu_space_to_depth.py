"""The Triton SpaceToDepth stem kernel (``runtime/space_to_depth.py``) against fp64, and its use in
``compile(model)`` on SE-ResNet9's depth backbone. All tests carry ``@pytest.mark.gpu`` (and skip
without Triton)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import needs_triton_kernel, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup

pytestmark = pytest.mark.gpu


_needs_triton = needs_triton_kernel("fusion_compiler.kernels.space_to_depth", "_triton_kernel",
                                    "space_to_depth_conv")


EPILOGUES = {  # (ops, outputs, operand kinds): 1 add, 2 sub, 3 mul, 4 div, 5 relu, 6 sigmoid, 7 tanh
    "conv": ([], [0], []),
    "relu_bias_two_outputs": ([5, 1], [1, 2], ["channel"]),  # the SE-ResNet9 stem
    "bias_relu_scale": ([1, 5, 3], [3], ["channel", "scalar"]),
    "all_kinds": ([2, 6, 4, 7], [4, 2], ["channel", "positive"]),
}


@pytest.mark.parametrize("n,c,h,w,k", [(512, 11, 64, 64, 64), (128, 3, 64, 64, 64),
                                       (5, 3, 32, 128, 32), (3, 2, 96, 32, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("epilogue", sorted(EPILOGUES))
def test_kernel_matches_fp64(n, c, h, w, k, dtype, epilogue):
    from fusion_compiler.kernels.space_to_depth import (kernel_reason, space_to_depth_conv,
                                                        space_to_depth_conv_reference)

    torch.manual_seed(0)
    ops, outputs, kinds = EPILOGUES[epilogue]
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    weight = (torch.randn(k, 16 * c, 1, 1, device="cuda") / (16 * c) ** 0.5).to(dtype)
    make = {"channel": lambda: torch.randn(1, k, 1, 1, device="cuda").to(dtype),
            "scalar": lambda: torch.tensor([0.75], device="cuda"),
            "positive": lambda: (torch.rand(k, device="cuda") + 0.5).to(dtype)}
    operands = [make[kind]() for kind in kinds]
    assert kernel_reason(x, weight, 4) == ""
    got = space_to_depth_conv(x, weight, operands, ops, outputs, 4)
    want = space_to_depth_conv_reference(x.double(), weight.double(),
                                         [o.double() for o in operands], ops, outputs, 4)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for g, wv in zip(got, want):
        assert g.dtype == dtype and g.shape == (n, k, h // 4, w // 4)
        assert g.is_contiguous(memory_format=torch.channels_last)
        assert rel_err(g, wv) < tol


def test_depth_backbone_stem_is_one_triton_kernel_in_the_graph(tmp_path):
    """``compile(model)`` (defaults: CUDA graph; the glue is this package's SE kernels) gives
    SE-ResNet9-depth's stem the Triton kernel: one replay holds it and the 8 cuDNN convolutions
    (11 after the stem, three pairs merged by horizontal fusion),
    and no copy of the image (the SpaceToDepth the graph held before); outputs match fp64."""
    from torch.profiler import ProfilerActivity, profile

    model = randomize_(se_resnet9_fixup(11), seed=4).cuda().half().eval()
    compiled = fc.compile(model, cache_dir=tmp_path, autotune=1, tiered=False)
    xs = [torch.rand(64, 11, 64, 64, device="cuda", dtype=torch.half) for _ in range(2)]
    with torch.inference_mode():
        outs = [compiled(x).clone() for x in (*xs, *xs)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(xs[0])
            torch.cuda.synchronize()
    spec = compiled.last
    assert spec.cuda_graph == "safe" and spec.glue_backend is None and spec.notes == []
    stem = spec.regions[0]
    assert (stem.backend, stem.pattern) == ("triton_stem", "[space_to_depth4] conv1x1 > relu > add")
    assert all(r.backend in ("cudnn", "dense") for r in spec.regions[1:])  # dense: 2x2 images
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("space_to_depth_conv_kernel" in n for n in names) == 1, names
    cudnn = sum(r.backend == "cudnn" for r in spec.regions)
    assert cudnn >= 7 and sum("cudnn" in n or "xmma" in n for n in names) == cudnn, names
    assert not any("permute" in n for n in names), names
    for out, x in zip(outs, (*xs, *xs)):
        with torch.no_grad():
            want = copy.deepcopy(model).double().cpu()(x.double().cpu())
        assert rel_err(out.float().cpu(), want) < 2e-3
