"""Training through cuDNN on a GPU: fused backward gradients against an fp64 reference, and a
training loop against eager. All tests carry ``@pytest.mark.gpu``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import FUSE_ALL, gradients, loss, lowered_or_pytorch_faster

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from test_fuse_patterns import PATTERNS

pytestmark = pytest.mark.gpu
SCALAR_TOL = 1e-1


LOSS_SCALE = 1024.0
"""A static loss scale, as fp16 training uses: an unscaled mean over 10^5 elements gives fp16
gradients in the subnormal range."""


def _l2_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e||: a few ReLU masks flipped by fp16 rounding (eager fp16 flips some too)
    move single elements a lot but the norm little."""
    return ((actual - expected).norm() / expected.norm()).item()


def _check_cudnn_gradients(model: nn.Module, x: torch.Tensor, tol: float = 5e-3,
                           input_grad: bool = True, backend: str = "cudnn", **options):
    """fp16 gradients through cuDNN regions (``backend``: the backend every region must be
    lowered to) against the fp64 gradients of the same model.

    Each gradient's L2 relative error must be at most ``tol`` or 10x eager fp16's own error.
    One-element gradients (the Fixup scalars) get ``SCALAR_TOL``: each is a sum over 10^5-10^6
    terms with cancellation (for layer1.bias1b of the reference network the terms' absolute sum
    is 41x the sum), so a small coherent error in the terms shows up amplified. Measured on an
    H200 (``test_reference_network_gradients_through_cudnn``: seed 3, N=32):
    layer1.bias1b 5.6e-2 (6.4e-2 with Inductor glue; eager fp16 4.5e-3), every other scalar of
    the network at most 5.5e-3, and with seed 5, N=64 every scalar at most 1.7e-2 (eager 2.0e-2).
    Eager's 4.5e-3 depends on its kernels: with cuDNN disabled, eager fp16 gave 3.8e-2 on an
    H100 (see :mod:`fusion_compiler.backward`). The 50-step loop test shows training tracks eager
    regardless.
    """
    reference = copy.deepcopy(model).double()
    want = gradients(reference, reference, x.double(), input_grad=input_grad, scale=LOSS_SCALE)
    model = model.cuda().half()
    eager = gradients(model, model, x.cuda().half(), input_grad=input_grad, scale=LOSS_SCALE)
    options.setdefault("autotune", 1)
    options.setdefault("glue_backend", None)  # Inductor only where a test asks for it
    compiled = fc.compile(model, cache_dir=False, **options)
    got = gradients(model, compiled, x.cuda().half(), input_grad=input_grad, scale=LOSS_SCALE)
    assert set(got) == set(want)
    for name, w in want.items():
        if w.abs().max() > 0:
            err, eager_err = _l2_err(got[name], w), _l2_err(eager[name], w)
            bound = SCALAR_TOL if w.numel() == 1 else max(tol, 10 * eager_err)
            assert err < bound, f"{name}: L2 error {err:.3g}, eager fp16 {eager_err:.3g}"
    regions = compiled.last.regions
    assert all(r.backend == backend for r in regions), [(r.region_id, r.reason) for r in regions]
    return compiled


@pytest.mark.parametrize("fusion", ["default", "all"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_gradients_through_cudnn(name, fusion):
    torch.manual_seed(0)
    factory, shape = PATTERNS[name]
    compiled = _check_cudnn_gradients(factory().eval(), torch.randn(shape),
                                      **(FUSE_ALL if fusion == "all" else {}))
    for r in compiled.last.regions:  # dgrad and wgrad both run as cuDNN graphs
        dgrad = "dgrad_drelu" if r.dgrad_drelu else "dgrad"
        assert [(p.kind, p.backend) for p in r.gradients] == [(dgrad, "cudnn"),
                                                               ("wgrad", "cudnn")], r.gradients
    if name in ("conv_relu_chain", "bottleneck"):  # a ReLU output read by one stride-1 conv
        assert any(r.dgrad_drelu for r in compiled.last.regions)


@pytest.mark.parametrize("fusion", ["default", "all"])
def test_reference_network_gradients_through_cudnn(fusion):
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=3).train()
    compiled = _check_cudnn_gradients(model, torch.randn(32, 3, 64, 64), input_grad=False,
                                      **(FUSE_ALL if fusion == "all" else {}))
    stem = compiled.last.regions[0]  # conv1x1 on the channels_last SpaceToDepth copy
    assert [p.backend for p in stem.gradients] == ["pytorch", "cudnn"]
    assert "not needed" in stem.gradients[0].reason  # the image needs no dgrad


def test_reference_network_gradients_with_inductor_glue():
    """``glue_backend="inductor"``: AOTAutograd traces each region's backward formula (dgrad and
    wgrad as opaque cuDNN calls) and Inductor fuses its pointwise rules with the ops between
    regions; gradients keep the cuDNN path's accuracy."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=3).train()
    compiled = _check_cudnn_gradients(model, torch.randn(32, 3, 64, 64), input_grad=False,
                                      glue_backend="inductor")
    assert all(p.backend == "cudnn" for r in compiled.last.regions[1:] for p in r.gradients)


def test_torchvision_resnet18_training_with_inductor_glue():
    """A torchvision CNN in train mode (batch norm on batch statistics, so not folded: each
    region is a bare convolution) through cuDNN regions and Inductor glue."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    compiled = _check_cudnn_gradients(models.resnet18(num_classes=10).train(),
                                      torch.randn(8, 3, 64, 64), input_grad=False,
                                      glue_backend="inductor")
    assert len(compiled.last.regions) == 20


def test_channels_last_parameters():
    """Parameters stored channels_last (``model.to(memory_format=torch.channels_last)``, which
    saves the per-step weight and gradient layout copies): same gradients, and each weight
    gradient comes back in its parameter's layout."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=3).train().to(memory_format=torch.channels_last)
    compiled = _check_cudnn_gradients(model, torch.randn(32, 3, 64, 64), input_grad=False)
    for name, p in model.named_parameters():
        if p.dim() == 4 and p.shape[-1] > 1:  # a 1x1 weight's strides are both layouts at once
            assert p.grad.stride() == p.stride(), name
    assert all(p.backend == "cudnn" for r in compiled.last.regions[1:] for p in r.gradients)


def test_autotuned_backward_pieces_are_never_slower_than_pytorch():
    model = randomize_(se_resnet9_fixup(3), seed=4).cuda().half().train()
    compiled = fc.compile(model, cache_dir=False, autotune=4, glue_backend=None)
    loss(compiled(torch.randn(256, 3, 64, 64, device="cuda", dtype=torch.half)),
         LOSS_SCALE).backward()
    for r in compiled.last.regions:
        for p in r.gradients:
            if p.cudnn_ms is not None:  # no margin: the faster of the two timings, cuDNN on a tie
                faster = "pytorch" if p.pytorch_ms < p.cudnn_ms else "cudnn"
                assert p.backend == faster, (r.region_id, p)


def _train(monkeypatch, **kwargs) -> list:
    """``examples.train_seresnet9.train(**kwargs)``'s curve, after checking that the training
    specialization of the module it compiled ran its regions on GPU kernels (or on PyTorch's ops
    where autotuning timed them faster), not on PyTorch's ops by a fallback."""
    from examples.train_seresnet9 import train

    made = []
    compile_ = fc.compile
    monkeypatch.setattr(fc, "compile", lambda *a, **k: made.append(compile_(*a, **k)) or made[-1])
    curve = train(**kwargs)
    spec = made[0].last
    assert spec.training and spec.regions, made[0].report()
    assert all(lowered_or_pytorch_faster(r) for r in spec.regions), made[0].report()
    return curve


def test_training_loop_tracks_eager_for_50_steps(monkeypatch):
    curve = _train(monkeypatch, steps=50, batch=64, precision="fp16", device="cuda", lr=0.02,
                   log_every=1)
    assert len(curve) == 50
    for step, eager, ours in curve:
        assert abs(ours - eager) <= 0.02 * abs(eager), (step, eager, ours)


@pytest.mark.parametrize("precision", ["autocast-fp16", "autocast-bf16"])
def test_autocast_training_tracks_eager(precision, monkeypatch):
    curve = _train(monkeypatch, steps=20, batch=64, precision=precision, device="cuda", lr=0.02,
                   log_every=1)
    for step, eager, ours in curve:
        assert abs(ours - eager) <= 0.03 * abs(eager), (step, eager, ours)


@pytest.mark.parametrize("cuda_graph", ["auto", False])
def test_a_gradient_penalty_through_cudnn_regions_raises_at_the_second_backward(cuda_graph):
    """A gradient penalty (``torch.autograd.grad(..., create_graph=True)``, then a backward
    through the result): the first gradients equal those of a plain backward, and the backward
    through them raises (the captured backward and the cuDNN dgrad/wgrad kernels are not
    differentiable), never silently dropping the regions' terms. Without CUDA graphs the glue
    is Inductor's, whose donated buffers make the first gradient raise after a plain backward
    (PyTorch's message names the option that turns them off), as under ``torch.compile``."""
    torch.manual_seed(0)
    factory, shape = PATTERNS["conv_relu_chain"]
    model = factory().cuda().half().train()
    compiled = fc.compile(model, cache_dir=False, autotune=1, cuda_graph=cuda_graph)
    for _ in range(3):  # past tier 0 (PyTorch ops), whose double backward is eager's
        compiled.wait_for_background_compiles()
        x = torch.randn(shape, device="cuda", dtype=torch.half, requires_grad=True)
        # a forward for each backward: a CUDA-graphed forward's activations serve one backward
        plain, = torch.autograd.grad(compiled(x).float().square().mean(), x)
        try:
            first, = torch.autograd.grad(compiled(x).float().square().mean(), x,
                                         create_graph=True)
        except RuntimeError as exc:  # AOTAutograd's own refusal, before any value is computed
            assert cuda_graph is False and "donated buffer" in str(exc), exc
            return
    assert all(r.backend == "cudnn" for r in compiled.last.regions)
    assert _l2_err(first.float(), plain.float()) < 1e-3
    with pytest.raises(RuntimeError, match="second derivative|differentiate twice|double backward"):
        first.float().square().sum().backward()
