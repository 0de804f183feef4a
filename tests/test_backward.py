"""The derived backward of fused regions (``fusion_compiler.backward``), checked on the CPU.

Regions run through the ``run_region`` custom op with ``RegionBackward`` and PyTorch's conv
gradients (``options=DERIVED_BACKWARD``): the path cuDNN regions take, with dgrad/wgrad swapped for
PyTorch's. Gradients are compared in float64 against eager autograd.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import DERIVED_BACKWARD, FUSE_ALL, gradients, rel_err

from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.autograd.backward import (RegionBackward, TorchConvGradients, folded_scale,
                                      saved_nodes, training_region)
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.runtime.region_op import register_backward, register_kernel, run_region
from test_fuse_patterns import PATTERNS


def _compare(model: nn.Module, x: torch.Tensor, **options) -> CompiledModule:
    compiled = CompiledModule(model, backends=(), options=DERIVED_BACKWARD, **options)
    got = gradients(model, compiled, x)
    want = gradients(model, model, x)
    assert set(got) == set(want)
    checked = 0
    for name, w in want.items():
        if w.abs().max() > 0:  # a ReLU that is off everywhere gives an all-zero gradient
            assert rel_err(got[name], w) < 1e-10, name
            checked += 1
    assert checked >= len(want) // 2
    regions = compiled.last.regions
    assert regions and all(r.kernel is not r.graph_module for r in regions)  # the custom op ran
    return compiled


@pytest.mark.parametrize("fusion", ["default", "all"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_gradients_match_autograd(name, fusion):
    torch.manual_seed(0)
    factory, shape = PATTERNS[name]
    model = factory().double()
    _compare(model, torch.randn(shape, dtype=torch.float64), **(FUSE_ALL if fusion == "all" else {}))


@pytest.mark.parametrize("fusion", ["default", "all"])
def test_reference_network_gradients_match_autograd(fusion):
    model = randomize_(se_resnet9_fixup(3), seed=1).double().train()
    compiled = _compare(model, torch.randn(4, 3, 64, 64, dtype=torch.float64),
                        **(FUSE_ALL if fusion == "all" else {}))
    assert len(compiled.last.regions) == 12


def test_a_half_precision_exit_sum_gets_a_gradient_of_its_input_dtype():
    """A bf16 region that ends in the squeeze ``sum(x, [2, 3], dtype=torch.float32)`` (the
    canonical half-precision mean) receives an fp32 gradient; its backward must hand bf16 on to
    the convolution's dgrad and wgrad, as eager autograd does. Before, the fp32 gradient reached
    the convolution gradients of a bf16 input (an error on the CPU; the GPU suite's
    fused-reduction training tests failed on it)."""
    torch.manual_seed(0)
    factory, shape = PATTERNS["fixup_block"]
    model = factory().eval()
    x = torch.randn(shape)
    reference = copy.deepcopy(model).double()
    want = gradients(reference, reference, x.double())
    model = model.to(torch.bfloat16)
    eager = gradients(model, model, x.to(torch.bfloat16))
    compiled = CompiledModule(model, backends=(), options=DERIVED_BACKWARD, **FUSE_ALL)
    got = gradients(model, compiled, x.to(torch.bfloat16))
    assert any(r.pattern.endswith("+ sum_hw") for r in compiled.last.regions)
    for name, w in want.items():
        err, eager_err = rel_err(got[name], w), rel_err(eager[name], w)
        assert err <= 1.5 * eager_err + 1e-3, f"{name}: {err:.3g}, eager bf16 {eager_err:.3g}"


def test_dgrad_applies_the_producing_relu_backward_once():
    """A stride-1 convolution reading another region's ReLU output (and nothing else reading it)
    gets ``dgrad_drelu``; the producer passes that gradient through its ReLU: one
    ``threshold_backward`` per ReLU in the whole backward, and gradients equal autograd's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from test_fuse_patterns import _conv_relu_chain

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func is torch.ops.aten.threshold_backward.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = _conv_relu_chain().double()
    compiled = _compare(model, torch.randn(4, 8, 6, 6, dtype=torch.float64))
    r0, r1, r2 = compiled.last.regions
    assert [r.dgrad_drelu for r in (r0, r1, r2)] == [False, True, True]
    assert "not a region output" in r0.dgrad_drelu_reason  # the network input
    assert r0.masked_outputs == {"relu"} and r1.masked_outputs == {"relu_1"}
    x = torch.randn(4, 8, 6, 6, dtype=torch.float64, requires_grad=True)
    out = compiled(x).square().sum()
    with Count():
        out.backward()
    assert Count.calls == 2


def test_dgrad_drelu_reasons_on_the_reference_network():
    model = randomize_(se_resnet9_fixup(3), seed=1).double().train()
    compiled = CompiledModule(model, backends=(), options=DERIVED_BACKWARD)
    compiled(torch.randn(2, 3, 64, 64, dtype=torch.float64)).sum().backward()
    reasons = {r.region_id: r.dgrad_drelu_reason for r in compiled.last.regions}
    assert not any(r.dgrad_drelu for r in compiled.last.regions)
    assert "stride 2x2" in reasons["r3"]
    assert "an add after its ReLU" in reasons["r2"]  # conv2 reads relu(...) + bias2a


def test_backward_frees_what_the_forward_saved_without_the_cyclic_gc():
    """After backward, nothing the regions saved stays alive waiting for ``gc.collect()`` (a
    kept-alive autograd graph also breaks CUDA-graph capture of the next steps: its gradient
    accumulators keep the stream of the step that made them)."""
    import gc
    import weakref

    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    compiled = CompiledModule(model, backends=(), options=DERIVED_BACKWARD)
    x = torch.randn(2, 8, 6, 6)
    compiled(x).square().mean().backward()  # compile outside the measured step
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(2, 8, 6, 6)
        saved = weakref.ref(x)  # the region saves its input for the wgrad
        compiled(x).square().mean().backward()
        del x
        assert saved() is None
    finally:
        gc.enable()


def test_glue_backend_traces_regions_and_their_backward():
    """``glue_backend``: Dynamo and AOTAutograd trace the specialized graph, each region an opaque
    ``run_region`` call, and the regions' backward formulas; inference and gradients equal eager
    (``aot_eager`` here: Inductor's CPU code generation takes minutes on CI machines; the GPU
    tests run ``"inductor"``)."""
    model = randomize_(se_resnet9_fixup(3), seed=1).double().train()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    compiled = _compare(model, x, glue_backend="aot_eager")
    assert len(compiled.last.regions) == 12
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-12
    assert len(compiled.specializations) == 2  # training and inference


def _region_op(region, conv_grads=None):
    """Run ``region`` (training copy) through the custom op with the derived backward."""
    train = training_region(region)
    key = register_kernel(train.graph_module, train.output_specs())
    register_backward(key, RegionBackward(train, conv_grads or TorchConvGradients(train.conv)))
    return train, key


def _random_inputs(region, requires_grad: bool = True) -> list[torch.Tensor]:
    """Random float64 tensors shaped like ``region``'s graph inputs."""
    return [torch.randn(ph.meta["val"].shape, dtype=torch.float64, requires_grad=requires_grad)
            for ph in region.graph_module.graph.find_nodes(op="placeholder")]


def _outputs_through_op(key: int, region):
    """The function ``inputs -> region's outputs`` through the custom op (without the values
    it saves for its backward)."""
    return lambda *xs: tuple(run_region(key, list(xs)))[:len(region.output_nodes)]


def _fixup_region(index: int, **options):
    """Region ``index`` of a small SE-Fixup block (stride 1): 0 is ``conv3x3 > add > relu > add``
    without prologue fusion, 1 is ``[add] conv3x3 > mul > add + sum_hw`` with everything fused."""
    from examples.seresnet9_fixup import SEFixupBlock

    model = randomize_(SEFixupBlock(8, 8, 1, reduction=4), seed=2).double()
    compiled = CompiledModule(model, backends=(), **{**FUSE_ALL, **options})
    with torch.no_grad():
        spec = compiled.specialize(torch.randn(2, 8, 4, 4, dtype=torch.float64))
    return spec.regions[index]


def test_training_region_saves_what_the_backward_reads():
    region = _fixup_region(1)  # the Fixup scale folds into the conv backward: nothing saved
    assert region.pattern == "[add] conv3x3 > mul > add + sum_hw"
    assert folded_scale(region) is next(n for n in region.graph_module.graph.nodes
                                        if n.target is torch.mul)
    assert saved_nodes(region) == [] and training_region(region) is region
    relu_region = _fixup_region(0, fuse_prologue=False)  # conv3x3 > add > relu > add
    assert [n.target for n in saved_nodes(relu_region)] == [torch.relu]
    train = training_region(relu_region)
    assert len(train.output_nodes) == len(relu_region.output_nodes) + 1
    assert [n.name for n in train.output_nodes[:-1]] == [n.name for n in relu_region.output_nodes]


def test_gradcheck_float64_through_the_custom_op():
    region = _fixup_region(1)
    train, key = _region_op(region)
    inputs = _random_inputs(train)
    assert torch.autograd.gradcheck(_outputs_through_op(key, region), inputs, eps=1e-6,
                                    atol=1e-7)


def test_a_second_derivative_through_a_region_raises_instead_of_dropping_terms():
    """``create_graph=True`` (a gradient penalty): the first gradients are the usual ones, and
    differentiating them raises at once; silently, the region's non-differentiable backward
    kernels would make them constants and drop the penalty's terms."""
    region = _fixup_region(1)
    train, key = _region_op(region, _Opaque(region.conv))
    inputs = _random_inputs(train)
    first = torch.autograd.grad(run_region(key, inputs)[0].sum(), inputs)
    again = torch.autograd.grad(run_region(key, inputs)[0].sum(), inputs, create_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    penalty = sum(g.square().sum() for g in again)
    with pytest.raises(RuntimeError, match="second derivative through a fused region"):
        penalty.backward()


class _Opaque(TorchConvGradients):
    """dgrad and wgrad as kernels autograd cannot follow (as cuDNN's are)."""

    differentiable = False

    def _backward(self, dy, x, w, mask):
        with torch.no_grad():
            return super()._backward(dy, x, w, mask)


def test_a_second_derivative_through_pytorch_gradients_is_eager_s():
    """Where dgrad and wgrad are PyTorch's (a region whose gradients run as PyTorch ops), a
    second derivative through the region is right: gradgradcheck in float64."""
    region = _fixup_region(1)
    train, key = _region_op(region)
    inputs = _random_inputs(train)
    assert torch.autograd.gradgradcheck(_outputs_through_op(key, region), inputs, eps=1e-6,
                                        atol=1e-6)


class _Counting(TorchConvGradients):
    def __init__(self, conv):
        super().__init__(conv)
        self.calls = []

    def dgrad(self, dy, x, w):
        self.calls.append("dgrad")
        return super().dgrad(dy, x, w)

    def wgrad(self, dy, x, w):
        self.calls.append("wgrad")
        return super().wgrad(dy, x, w)


def test_frozen_weight_and_input_get_no_gradient_computed():
    region = _fixup_region(0, fuse_prologue=False)
    counting = _Counting(region.conv)
    train, key = _region_op(region, counting)
    image, weight, *scalars = _random_inputs(train, requires_grad=False)
    for s in scalars:
        s.requires_grad_()
    out = run_region(key, [image, weight, *scalars])[0]
    out.sum().backward()
    assert counting.calls == []  # only the scalar biases needed gradients
    assert all(s.grad is not None and s.grad.abs().sum() > 0 for s in scalars)
    weight.requires_grad_()
    run_region(key, [image, weight, *scalars])[0].sum().backward()
    assert counting.calls == ["wgrad"]


def test_inference_kernel_refuses_backward():
    region = _fixup_region(0, fuse_prologue=False)
    key = register_kernel(region.graph_module, region.output_specs())
    inputs = _random_inputs(region)
    out = run_region(key, inputs)[0]
    with pytest.raises(RuntimeError, match="compiled for inference"):
        out.sum().backward()


def test_network_input_without_grad_is_marked_for_no_dgrad():
    model = randomize_(se_resnet9_fixup(3), seed=1).double()
    compiled = CompiledModule(model, backends=(), options=DERIVED_BACKWARD)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    compiled(x).sum().backward()
    stem = compiled.last.regions[0]
    image = next(iter(stem.graph_module.graph.find_nodes(op="placeholder"))).name
    assert stem.no_grad_inputs == {image}
    compiled(x.requires_grad_()).sum().backward()  # a new specialization: now dgrad is needed
    assert len(compiled.specializations) == 2 and compiled.last.regions[0].no_grad_inputs == set()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_autocast_training_forms_the_same_regions_and_tracks_eager():
    """fp32 weights under torch.autocast(bfloat16): the casts become graph ops, regions form in
    bfloat16 as for a bfloat16 model, and the whole gradient is as close to fp64 as eager's."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3), seed=1).train()
    x = torch.randn(4, 3, 64, 64)
    ref = copy.deepcopy(model).double()
    ref(x.double()).square().mean().backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters()])

    def whole_gradient(run):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
            out.float().square().mean().backward()
        return out, torch.cat([p.grad.double().flatten() for p in model.parameters()])

    compiled = CompiledModule(model, options=DERIVED_BACKWARD)
    out, got = whole_gradient(compiled)
    _, eager = whole_gradient(model)
    assert type(out) is torch.Tensor  # no fake tensor leaks from compile-time propagation
    l2 = lambda a: ((a - want).norm() / want.norm()).item()  # noqa: E731
    assert l2(got) < max(5e-3, 2 * l2(eager))
    spec = compiled.last
    assert "autocast" in spec.stages
    assert spec.training and "backward per region (dgrad, wgrad)" in compiled.report()
    assert [r.pattern for r in spec.regions][:3] == [
        "conv1x1 > relu > add", "conv3x3 > add > relu > add", "conv3x3 > mul > add"]
    assert all(r.conv.args[1].meta["val"].dtype == torch.bfloat16 for r in spec.regions)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # inference: hoisted casts
        assert ((compiled(x).float() - model(x).float()).norm() / model(x).float().norm()) < 2e-2


def test_kernels_and_their_backward_die_with_the_compiled_module():
    import gc

    from fusion_compiler.runtime import region_op

    model = randomize_(se_resnet9_fixup(3, base_planes=16), seed=1)
    compiled = CompiledModule(model, backends=(), options=DERIVED_BACKWARD)
    gc.collect()
    before = len(region_op._KERNELS)
    compiled(torch.randn(1, 3, 64, 64)).sum().backward()
    assert len(region_op._KERNELS) == before + 12
    del compiled
    gc.collect()
    assert len(region_op._KERNELS) == before


def test_layout_like_views_size_one_stride_differences_and_copies_only_when_asked():
    """A 1x1 weight's channels_last gradient gets the parameter's strides as a view (what DDP's
    bucket views compare); other layout differences are copied only with ``copy=True``."""
    from fusion_compiler.runtime.tensors import layout_like

    w = torch.randn(64, 48, 1, 1)
    g = torch.randn(64, 48, 1, 1).contiguous(memory_format=torch.channels_last)
    view = layout_like(g, w)
    assert view.stride() == w.stride() and view.data_ptr() == g.data_ptr()
    assert torch.equal(view, g)
    w3 = torch.randn(8, 4, 3, 3)
    g3 = torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    assert layout_like(g3, w3) is g3
    copied = layout_like(g3, w3, copy=True)
    assert copied.stride() == w3.stride() and torch.equal(copied, g3)


def test_region_keys_depend_on_what_a_kernel_computes_not_on_what_came_before():
    """A kernel's ``run_region`` key is a hash of its class, name and output specs, so the same
    graph gets the same keys in every process (Inductor's FX graph cache keys a graph by its
    text); equal ones take the next free integer, and a freed key is free again."""
    import gc

    class Kernel:
        def __call__(self, x):
            return (x.clone(),)

    specs = [((2, 3), (3, 1), torch.float32)]
    first, second = Kernel(), Kernel()
    a = register_kernel(first, specs, "region 1")
    register_kernel(Kernel(), [((4, 3), (3, 1), torch.float32)], "region 2")  # dropped at once
    b = register_kernel(second, specs, "region 1")
    assert b == a + 1 and run_region(a, [torch.ones(2, 3)])[0].shape == (2, 3)
    c = register_kernel(Kernel(), specs, "region 2")
    assert c not in (a, b) and 0 <= c < 2 ** 56 + 2
    del first
    gc.collect()
    assert register_kernel(Kernel(), specs, "region 1") == a
