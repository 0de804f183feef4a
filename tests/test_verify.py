"""The verify pass rejects graphs that break the cuDNN graph rules, naming the node."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from conftest import specialize

from fusion_compiler import FusionError
from fusion_compiler.passes import verify
from fusion_compiler.ir.region import Region


def _fused():
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    return specialize(model, torch.randn(2, 8, 6, 6)).graph_module


def _region(gm: fx.GraphModule) -> Region:
    return next(m for m in gm.modules() if isinstance(m, Region))


def test_clean_graph_passes():
    gm = _fused()
    assert verify(gm) is gm


def test_inplace_node_in_region_is_rejected():
    gm = _fused()
    sub = _region(gm).graph_module
    relu = next(n for n in sub.graph.nodes if n.target is torch.relu)
    relu.target = torch.relu_
    with pytest.raises(FusionError, match="in-place") as info:
        verify(gm)
    assert info.value.node == relu.name


def test_inplace_node_in_top_level_graph_is_rejected():
    gm = _fused()
    out = gm.graph.find_nodes(op="output")[0]
    with gm.graph.inserting_before(out):
        bad = gm.graph.call_method("add_", (out.args[0], 1.0))
    with pytest.raises(FusionError, match="SSA") as info:
        verify(gm)
    assert info.value.node == bad.name


def test_output_aliasing_an_input_is_rejected():
    gm = _fused()
    sub = _region(gm).graph_module
    image = sub.graph.find_nodes(op="placeholder")[0]
    out = sub.graph.find_nodes(op="output")[0]
    out.args = ((*out.args[0], image),)
    with pytest.raises(FusionError, match="aliases its input"):
        verify(gm)


def test_conv_accumulating_into_output_is_rejected():
    gm = _fused()
    sub = _region(gm).graph_module
    conv = next(n for n in sub.graph.nodes if n.target is torch.conv2d)
    weight = conv.args[1]
    conv.args = (conv.args[0], weight, weight, *conv.args[3:])
    with pytest.raises(FusionError, match="beta must be 0") as info:
        verify(gm)
    assert info.value.node == conv.name


def test_reduction_read_inside_region_is_rejected():

    class Squeeze(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)

        def forward(self, x):
            y = self.conv(x)
            return y, y.sum((2, 3), keepdim=True)

    gm = specialize(Squeeze(), torch.randn(2, 8, 6, 6)).graph_module
    sub = _region(gm).graph_module
    red = next(n for n in sub.graph.nodes if n.target is torch.sum)
    out = sub.graph.find_nodes(op="output")[0]
    with sub.graph.inserting_before(out):
        sub.graph.call_function(torch.relu, (red,))
    with pytest.raises(FusionError, match="exit node"):
        verify(gm)
