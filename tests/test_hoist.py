"""Parameter-only subgraphs are hoisted out of inference graphs that a CUDA graph replays (and
of the CUDA pipeline ``dump`` shows), and recomputed before each call that is not replayed, so
they follow every kind of parameter update (passes/post_lowering/hoist.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import CUDA_PIPELINE, rel_err

import fusion_compiler as fc
from fusion_compiler.compiler import CompiledModule
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from test_fuse_patterns import _randomize_bn


def _hoisted(compiled) -> list[str]:
    return [n.target for n in compiled.last.graph_module.graph.nodes
            if n.op == "get_attr" and n.target.startswith("_hoisted_")]


@pytest.mark.parametrize("glue_backend", [None, "aot_eager"])
def test_downsample_weights_are_hoisted_and_follow_parameter_updates(glue_backend):
    """Also through ``torch.compile`` (``glue_backend``): the hoisted values are refreshed in
    place, and the compiled graph must read them, not constants traced on the first call."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).eval()
    # the CUDA pipeline, whose avgpool_conv rewrite makes the downsample weights (CPU inputs
    # leave the pools alone)
    compiled = CompiledModule(model, glue_backend=glue_backend, options=CUDA_PIPELINE)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5
        # the three AvgPool+1x1 downsample weights (the 3-channel stem keeps its 1x1 weight)
        assert len(_hoisted(compiled)) == 3
        code = compiled.last.graph_module.code
        assert "expand" not in code and "0.1111" not in code  # no per-call weight rewrite left
        for block in (model.layer1, model.layer2, model.layer3):
            block.downsample[1].weight.mul_(-0.5)  # an in-place update
        assert rel_err(compiled(x), model(x)) < 1e-5
        for block in (model.layer1, model.layer2, model.layer3):
            block.downsample[1].weight.data.mul_(3.0)  # one no version counter records
        assert rel_err(compiled(x), model(x)) < 1e-5


def _conv_bn_relu() -> nn.Module:
    """conv (no bias) -> eval batch norm with statistics far from their initial values -> ReLU."""
    return _randomize_bn(nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False),
                                       nn.BatchNorm2d(16), nn.ReLU())).eval()


def test_batch_norm_scale_and_shift_are_hoisted_and_follow_every_kind_of_update():
    """Updates no version counter records (``.data`` writes, running statistics moved by
    train-mode forwards) are seen as well as in-place ones."""
    torch.manual_seed(0)
    model = _conv_bn_relu()
    compiled = fc.compile(model, options=CUDA_PIPELINE)
    x = torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5
        assert _hoisted(compiled)
        assert "rsqrt" not in compiled.last.graph_module.code
        model[1].running_var.mul_(2.0)
        assert rel_err(compiled(x), model(x)) < 1e-5
        model[1].weight.data.mul_(-3.0)
        assert rel_err(compiled(x), model(x)) < 1e-5
        model.train()
        for _ in range(3):
            model(torch.randn(4, 8, 6, 6) * 2 + 1)
        model.eval()
        assert rel_err(compiled(x), model(x)) < 1e-5


def test_without_a_cuda_graph_nothing_is_hoisted_on_the_cpu():
    """The eval batch norm's scale and shift stay in the graph, computed at each call."""
    model = _conv_bn_relu()
    compiled = fc.compile(model)
    with torch.no_grad():
        compiled(torch.randn(2, 8, 6, 6))
    assert not _hoisted(compiled) and "rsqrt" in compiled.last.graph_module.code


def test_nothing_is_hoisted_while_gradients_are_needed():
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).eval()
    compiled = fc.compile(model)
    x = torch.randn(2, 3, 64, 64)
    compiled(x).square().mean().backward()
    assert not _hoisted(compiled)
    grad = model.layer1.downsample[1].weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_hoisted_values_are_refreshed_without_autograd_history():
    """``refresh`` ran with gradients on (``inference_mode(False)`` inside ``no_grad`` turns them
    back on): each call without a CUDA graph chained one more copy onto the hoisted values'
    autograd history (a leak), and a later call with frozen parameters returned an output that
    required grad where eager's does not."""
    torch.manual_seed(0)
    model = _conv_bn_relu()
    compiled = fc.compile(model, options=CUDA_PIPELINE)
    x = torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    gm = compiled.last.graph_module
    hoisted = [getattr(gm, name) for name in _hoisted(compiled)]
    assert hoisted and not any(t.requires_grad or t.grad_fn for t in hoisted)
    model.requires_grad_(False)
    assert not compiled(x).requires_grad and not model(x).requires_grad


class _ReturnsMade(nn.Module):
    """Returns, beside its features, tensors made from constants and from a parameter alone."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        return (self.conv(x) * self.scale[:, None, None], torch.zeros(3), torch.ones(2) * 2,
                self.scale * 2, (self.scale + 1).view(2, 4))


@pytest.mark.parametrize("options", [None, CUDA_PIPELINE], ids=["cpu", "cuda_pipeline"])
def test_outputs_made_from_constants_or_parameters_are_new_at_each_call(options):
    """Eager makes those tensors anew at each call; the trace kept the constants as one tensor,
    and hoisting made the parameter-only ones tensors the graph reads: every call returned the
    same tensor, and a caller's write into it changed every later call's output (CPU: 0, 1, 2
    in three calls where eager gives 0 each time)."""
    torch.manual_seed(0)
    model = _ReturnsMade().eval()
    compiled = CompiledModule(model, options=options)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(3):
            got, want = compiled(x), model(x)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
                g.add_(1.0)  # the caller's own use of its output
    assert not any(n.op == "get_attr" and str(n.target).startswith("_hoisted_") and any(
        u.op == "output" for u in n.users) for n in compiled.last.graph_module.graph.nodes)


class _SharesAConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        z = torch.zeros(8)
        return y, z.view(y.shape[0], -1), z, z[:2]


def test_outputs_made_from_one_constant_share_its_copy_as_eager_shares_the_tensor():
    """fx keeps each use of a constant, and a view taken on the spot, as constants of their own:
    copied one by one, ``return z, z[:2]`` gave two tensors where eager gives views of one
    (helper-51: a write into one no longer reached the other)."""
    model = _SharesAConstant().eval()
    compiled = CompiledModule(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for _ in range(2):
            got, want = compiled(x), model(x)
            got[1].add_(1.0)
            want[1].add_(1.0)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
