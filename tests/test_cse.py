"""Common-subexpression elimination before fusion (``passes/pre_fusion/cse.py``): equivalent
spellings give one graph, and nothing is merged that computes a different value."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler
from conftest import patterns, specialize
from examples.seresnet9_fixup import SEFixupBlock, randomize_
from fusion_compiler.capture import capture
from fusion_compiler.shapes import propagate_shapes
from fusion_compiler.passes.pre_fusion.cse import eliminate_common_subexpressions
from fusion_compiler.passes.pre_fusion.normalize import normalize


class AsTheAuthorsWroteIt(SEFixupBlock):
    """The block as the original code spells it: the scalar bias added to the input once for
    each reader."""

    def forward(self, x):
        out = F.relu(self.conv1(x + self.bias1a) + self.bias1b)
        out = self.conv2(out + self.bias2a) * self.scale + self.bias2b
        identity = self.downsample(x + self.bias1a)
        out = self.se(out) + identity
        return F.relu(out, inplace=True)


def _canonical(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    gm = capture(model)
    propagate_shapes(gm, list(inputs))
    return normalize(gm)


def test_the_authors_spelling_compiles_to_the_regions_of_the_example():
    model = randomize_(SEFixupBlock(16, 32, stride=2, reduction=8)).eval()
    theirs = AsTheAuthorsWroteIt(16, 32, stride=2, reduction=8).eval()
    theirs.load_state_dict(model.state_dict())
    x = torch.randn(2, 16, 8, 8)
    spec = specialize(theirs, x)
    assert patterns(spec) == patterns(specialize(model, x)) == [
        "[add] conv3x3/s2 > add > relu > add", "conv3x3 > mul > add + sum_hw"]
    assert spec.stages["cse"].count("torch.add(x, ") == 1  # the bias added once
    with torch.no_grad():
        torch.testing.assert_close(spec.run(x), model(x), rtol=1e-5, atol=1e-5)


def test_repeated_reads_and_pure_calls_merge_once():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.sigmoid(x * self.w) + torch.sigmoid(x * self.w)

    gm = _canonical(Twice(), torch.randn(2, 4))
    assert eliminate_common_subexpressions(gm) == 2  # a mul, a sigmoid (fx reads w once)
    gm.recompile()
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(torch.mul) == 1


def test_random_ops_grad_zones_and_buffer_reads_stay_apart():
    class Apart(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            noise = F.dropout(x, 0.5, True) + F.dropout(x, 0.5, True)
            with torch.no_grad():
                frozen = torch.tanh(x)
            before = x * self.bn.running_mean
            y = self.bn(x)  # train mode: writes running_mean
            after = x * self.bn.running_mean
            return noise + frozen + torch.tanh(x) + before + after + y

    model = Apart().train()
    gm = _canonical(model, torch.randn(3, 4))
    assert eliminate_common_subexpressions(gm) == 0
    gm.recompile()
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(F.dropout) == 2 and calls.count(torch.tanh) == 2
    assert calls.count(torch.mul) == 2


def test_returned_values_stay_two_tensors():
    class TwoOuts(nn.Module):
        def forward(self, y):
            return torch.relu(y + 1), torch.relu(y + 1)

    a, b = fusion_compiler.compile(TwoOuts())(torch.randn(2, 3))
    assert a is not b and a.data_ptr() != b.data_ptr()
    torch.testing.assert_close(a, b)


def test_calls_in_and_out_of_an_autocast_region_stay_apart():
    g = fx.Graph()
    x = g.placeholder("x")
    first = g.call_function(torch.tanh, (x,))
    enter = g.call_function(torch.amp.autocast_mode._enter_autocast, ("cpu", torch.bfloat16))
    second = g.call_function(torch.tanh, (x,))
    g.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
    g.output(g.call_function(torch.add, (first, second)))
    assert eliminate_common_subexpressions(fx.GraphModule(nn.Module(), g)) == 0
    plain = fx.Graph()  # the same without the autocast region: merged
    x = plain.placeholder("x")
    plain.output(plain.call_function(torch.add, (plain.call_function(torch.tanh, (x,)),
                                                 plain.call_function(torch.tanh, (x,)))))
    assert eliminate_common_subexpressions(fx.GraphModule(nn.Module(), plain)) == 1


def test_views_keep_their_dtype_keyword_calls_and_space_to_depth_splits():
    class Views(nn.Module):
        def forward(self, y):
            bits = torch.reshape(y.view(torch.int16), (-1,))  # a dtype view is no size-1 view
            row = torch.unsqueeze(input=y, dim=0)  # the input as a keyword
            return bits, row.reshape(2, -1) + 1

    model, y = Views(), torch.randn(4, 8)
    bits, rows = fusion_compiler.compile(model)(y)
    want_bits, want_rows = model(y)
    assert bits.dtype == torch.int16 and torch.equal(bits, want_bits)
    torch.testing.assert_close(rows, want_rows)
