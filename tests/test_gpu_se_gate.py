"""The Triton kernel behind the ``se_gate`` and ``se_scale`` glue ops (``kernels/se_gate.py``)
against fp64, and their use in ``compile(model)``'s defaults. All tests carry ``@pytest.mark.gpu``
(and skip without Triton)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_triton_kernel

pytestmark = pytest.mark.gpu


_needs_triton = needs_triton_kernel("fusion_compiler.kernels.se_gate", "_triton_kernel",
                                    "se_gate")


@pytest.mark.parametrize("n,c,h,w,r", [(128, 64, 16, 16, 4), (512, 512, 2, 2, 32), (5, 96, 7, 7, 6),
                                       (3, 24, 1, 1, 3)])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", ["relu", "silu"])
def test_se_gate_kernel_matches_fp64(n, c, h, w, r, layout, dtype, act):
    from fusion_compiler.kernels.se_gate import se_gate, se_gate_reference

    torch.manual_seed(0)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype) + 0.3
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    w1 = (torch.randn(r, c, device="cuda") / c ** 0.5).to(dtype)
    w2 = (torch.randn(c, r, device="cuda") / r ** 0.5).to(dtype)
    b1, b2 = (torch.randn(r, device="cuda").to(dtype), None) if c % 2 else (None, torch.randn(
        c, device="cuda").to(dtype))
    got = se_gate(x, w1, b1, w2, b2, act)
    want = se_gate_reference(x.double(), w1.double(), None if b1 is None else b1.double(),
                             w2.double(), None if b2 is None else b2.double(), act)
    assert got.dtype == dtype and got.shape == (n, c)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("n,c,h,w,r", [(128, 64, 16, 16, 4), (512, 512, 2, 2, 32),
                                       (5, 96, 7, 7, 6)])
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "nhwc-residual-nchw"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("tail", ["none", "residual-relu-bias", "relu"])
def test_se_scale_kernel_matches_fp64(n, c, h, w, r, layout, dtype, tail):
    from fusion_compiler.kernels.se_gate import se_scale, se_scale_reference

    torch.manual_seed(0)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype) + 0.3
    residual = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    if layout.startswith("nhwc"):
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "nhwc":
        residual = residual.contiguous(memory_format=torch.channels_last)
    w1 = (torch.randn(r, c, device="cuda") / c ** 0.5).to(dtype)
    w2 = (torch.randn(c, r, device="cuda") / r ** 0.5).to(dtype)
    b1, b2 = torch.randn(r, device="cuda").to(dtype), torch.randn(c, device="cuda").to(dtype)
    bias = torch.randn(1, device="cuda").to(dtype)
    args = {"none": (None, False, None), "relu": (None, True, None),
            "residual-relu-bias": (residual, True, bias)}[tail]
    got = se_scale(x, w1, b1, w2, b2, "relu", *args)
    want = se_scale_reference(*(t.double() for t in (x, w1, b1, w2, b2)), "relu",
                              *(t.double() if isinstance(t, torch.Tensor) else t for t in args))
    assert got.dtype == dtype and got.shape == x.shape and got.stride() == x.stride()
    tol = {torch.float16: 4e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_default_compile_runs_the_se_blocks_in_the_packages_kernels_without_inductor(
        monkeypatch):
    """SE-ResNet9 depth in fp16: the lowered graph calls the gate kernel for its four gates and
    applies each in the same kernel (``se_scale``), which leaves Inductor nothing to compile: the
    glue runs as eager ops in the CUDA graph, with no Inductor tier. One replay holds 4 SE
    kernels, the convolutions (cuDNN's; layer3's 2x2 one may be a cuBLAS GEMM) and the stem, and no Inductor kernel; the output stays
    within 1.5x eager fp16's error of an fp64 reference."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    import fusion_compiler as fc
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.passes.post_lowering.se_gate import se_gates, se_scales

    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(11)).eval()
    x = torch.rand(16, 11, 64, 64)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    half = model.cuda().half()
    xh = x.cuda().half()
    compiled = fc.compile(half, cache_dir=False, autotune=1)
    seen = []
    monkeypatch.setattr(fc.passes, "se_gates", lambda gm: seen.append(se_gates(gm)) or seen[-1])
    monkeypatch.setattr(fc.passes, "se_scales", lambda gm: seen.append(se_scales(gm)) or seen[-1])
    with torch.inference_mode():
        compiled(xh)
        assert compiled.wait_for_background_compiles(300)
        assert not compiled.last.run.pending
        got = compiled(xh).double().cpu()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(xh)
            torch.cuda.synchronize()
        eager = half(xh).double().cpu()
    assert seen == [4, 4]
    spec = compiled.last
    assert (spec.glue_backend, spec.cuda_graph, spec.notes) == (None, "safe", [])
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert names.count("se_kernel") == 4, names
    assert not any(n.startswith("triton_") for n in names), names  # no Inductor kernel
    # 9 regions (12 convolutions, 6 merged in pairs): the stem's, one may be the dense GEMM
    cudnn = sum(r.backend == "cudnn" for r in spec.regions)
    assert cudnn >= 7 and sum("cudnn" in n or "xmma" in n for n in names) == cudnn, names
    err = ((got - want).abs().max() / want.abs().max()).item()
    eager_err = ((eager - want).abs().max() / want.abs().max()).item()
    assert err <= 1.5 * eager_err + 1e-4, (err, eager_err)
