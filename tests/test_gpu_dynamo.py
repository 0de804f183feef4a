"""``torch.compile(model, backend="fusion_compiler")`` on a GPU: any batch sequence in inference
and training, cuDNN kernels inside the CUDA-graph replay, regions in every graph between graph
breaks, ``mode=`` accepted. All tests carry ``@pytest.mark.gpu``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import gradients, lowered_on_gpu, rel_err
from test_gpu_training import LOSS_SCALE, SCALAR_TOL, _l2_err

from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.dynamo import fusion_compiler_backend
from fusion_compiler.dynamo import wait_for_background_compiles
from test_fuse_patterns import BasicBlock, _randomize_bn
from test_trace_reads import _HooksItsFeatures

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fp64(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double().cpu()(x.double().cpu())


def _convolution_kernels(fn) -> list[str]:
    """Names of the convolution kernels one call of ``fn`` launches: cuDNN's, and cuBLAS's GEMMs
    (the ``dense`` backend's kernel for a convolution of a small image)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"
            and any(part in e.name for part in ("cudnn", "xmma", "nvjet", "gemm"))]


def test_inference_batch_sequence_and_convolution_kernels_in_the_replay(tmp_path):
    """128, 64, 32, 37, 1, 128 in a row (Dynamo turns the batch dynamic after the first size):
    each output matches fp64; once the background compiles end, one call replays a CUDA graph
    holding the 8 convolutions of the 11 after the stem (layers 1-3 run the first convolution and
    the downsample as one: horizontal fusion; cuDNN's, or a cuBLAS GEMM for layer3's 2x2 images;
    the stem is a Triton kernel)."""
    model = randomize_(se_resnet9_fixup(3), seed=1).cuda().half().eval()
    compiled = torch.compile(model, backend="fusion_compiler",
                             options={"cache_dir": str(tmp_path), "autotune": 1})
    with torch.inference_mode():
        for n in (128, 64, 32, 37, 1, 128):
            x = torch.randn(n, 3, 64, 64, device="cuda", dtype=torch.half)
            out = compiled(x)
            assert out.shape == (n, 512, 2, 2), out.shape
            assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3, n
        assert wait_for_background_compiles(timeout=120)
        kernels = _convolution_kernels(lambda: compiled(x))
        assert rel_err(compiled(x).float().cpu(), _fp64(model, x)) < 2e-3
    assert len(kernels) == 8, kernels


def test_training_batch_sequence_gradients_match_fp64():
    """Training steps at 64, 32, 37, 64: every gradient within fp16 tolerance of fp64's (the
    bound of test_gpu_training: 5e-3 or 10x eager fp16's L2 error; the Fixup scalars
    ``SCALAR_TOL``), every region of every graph on cuDNN (a training specialization has no
    tier 0)."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=3).cuda().half().train()
    reference = copy.deepcopy(model).double()
    seen = []

    def backend(gm, example_inputs):
        seen.append(fusion_compiler_backend(gm, example_inputs, options={"autotune": 1}))
        return seen[-1]

    compiled = torch.compile(model, backend=backend)
    for n in (64, 32, 37, 64):
        x = torch.randn(n, 3, 64, 64, device="cuda")
        want = gradients(reference, reference, x.double(), input_grad=False, scale=LOSS_SCALE)
        eager = gradients(model, model, x.half(), input_grad=False, scale=LOSS_SCALE)
        got = gradients(model, compiled, x.half(), input_grad=False, scale=LOSS_SCALE)
        assert set(got) == set(want)
        for name, w in want.items():
            if w.abs().max() > 0:
                err, eager_err = _l2_err(got[name], w), _l2_err(eager[name], w)
                bound = SCALAR_TOL if w.numel() == 1 else max(5e-3, 10 * eager_err)
                assert err < bound, f"N={n} {name}: L2 error {err:.3g}, eager {eager_err:.3g}"
        regions = [r for graph in seen for r in graph.compiled_module.last.regions]
        assert regions and all(lowered_on_gpu(r) for r in regions), [
            (r.region_id, r.reason) for r in regions]


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = BasicBlock(16, 16), BasicBlock(16, 32, 2)

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_every_graph_between_breaks_gets_cudnn_regions(tmp_path, mode):
    model = _randomize_bn(_Broken()).cuda().half().eval()
    seen = []

    def backend(gm, example_inputs):
        run = fusion_compiler_backend(gm, example_inputs, mode=mode,
                                      options={"cache_dir": str(tmp_path), "autotune": 1})
        seen.append(run)
        return run

    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 16, 32, 32, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        compiled(x)
        assert wait_for_background_compiles(timeout=120)
        out = compiled(x)
    assert rel_err(out.float().cpu(), _fp64(model, x)) < 2e-3
    assert len(seen) == 2
    for graph in seen:
        spec = graph.compiled_module.last
        assert spec.regions and all(lowered_on_gpu(r) for r in spec.regions)
        assert spec.cuda_graph == (None if mode == "max-autotune-no-cudagraphs" else "safe")


def test_a_tensor_hook_in_forward_is_called_at_every_training_step(tmp_path):
    """A captured backward would call the hook at capture only: a graph registering it runs
    its step without a CUDA graph (torch 2.13's Dynamo writes ``higher_order.register_hook``;
    2.11's writes a hook it can trace as an ``autograd_function_apply``, its backward then in
    the captured graph), and the gradients are eager's at every step (fp32 weights; the convolutions
    run in TF32, PyTorch's cuDNN default, eager's and ours by different kernels: 3e-4 apart
    on the H200, session 52). Without the hook the first convolution's gradients would be
    twice eager's (an error of 1)."""
    torch.manual_seed(0)
    model = _HooksItsFeatures().cuda()
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="fusion_compiler", options={"cache_dir": str(tmp_path)})
    for step in range(4):
        x = torch.randn(8, 3, 16, 16, device="cuda")
        for m, fn in ((model, model), (twin, compiled)):
            m.zero_grad()
            fn(x).square().sum().backward()
        wait_for_background_compiles(600)
        for p, q in zip(twin.parameters(), model.parameters()):
            assert rel_err(p.grad, q.grad) < 2e-3, step
