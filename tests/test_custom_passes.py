"""The user's own graph passes (option ``passes``): where they run, what they see, and the one
clear error when they fail; the example of docs/options.md, "passes"."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.config import CompileOptions
from fusion_compiler.ir.errors import FusionError
from fusion_compiler.ir.region import Region
from conftest import CUDA_PIPELINE


class ConvHardswish(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return F.hardswish(self.conv(x))


def hardswish_as_formula(gm: fx.GraphModule) -> None:
    """The example of docs/options.md: ``hardswish(x)`` as ``x * clamp(x + 3, 0, 6) / 6``."""
    g = gm.graph
    for node in list(g.find_nodes(op="call_function", target=F.hardswish)):
        x = node.args[0]
        with g.inserting_before(node):
            gate = g.call_function(torch.clamp, (g.call_function(torch.add, (x, 3.0)), 0.0, 6.0))
            out = g.call_function(torch.mul, (x, g.call_function(torch.mul, (gate, 1 / 6))))
        node.replace_all_uses_with(out)
        g.erase_node(node)


def _region_ops(compiled) -> list[str]:
    return [str(n.target) for r in compiled.last.regions
            for n in r.graph_module.graph.nodes if n.op == "call_function"]


def test_a_pre_fusion_pass_lets_the_chain_fuse_and_keeps_the_numerics():
    torch.manual_seed(0)
    model, x = ConvHardswish(), torch.randn(2, 3, 8, 8)
    plain = fusion_compiler.compile(model, options=CUDA_PIPELINE)
    plain(x)
    assert not any("clamp" in op for op in _region_ops(plain))
    assert "hardswish" in plain.report()  # left to PyTorch, and said so
    rewritten = fusion_compiler.compile(model, options=CUDA_PIPELINE,
                                        passes={"pre_fusion": [hardswish_as_formula]})
    out = rewritten(x)
    assert any("clamp" in op for op in _region_ops(rewritten)), rewritten.report()
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def test_the_pass_finds_hardswish_written_as_a_module():
    """``nn.Hardswish`` (MobileNetV3's spelling, in place or not) becomes ``F.hardswish`` in
    ``normalize``, so the example pass reaches it as it reaches the function."""
    torch.manual_seed(0)
    for inplace in (False, True):
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish(inplace=inplace))
        x = torch.randn(2, 3, 8, 8)
        compiled = fusion_compiler.compile(model, options=CUDA_PIPELINE,
                                           passes={"pre_fusion": [hardswish_as_formula]})
        out = compiled(x)
        assert any("clamp" in op for op in _region_ops(compiled)), compiled.report()
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def test_a_post_lowering_pass_sees_the_lowered_regions_on_the_calling_thread():
    seen = []

    def count_regions(gm: fx.GraphModule) -> fx.GraphModule:
        seen.append((sum(isinstance(m, Region) for m in gm.modules()),
                     threading.current_thread() is threading.main_thread()))
        return gm

    model, x = ConvHardswish(), torch.randn(2, 3, 8, 8)
    compiled = fusion_compiler.compile(model, passes={"post_lowering": count_regions})
    compiled(x)
    compiled.wait_for_background_compiles()  # (on CUDA the lowered tier comes at the switch)
    assert seen == [(1, True)]


def test_the_torch_compile_door_takes_the_passes():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = ConvHardswish(), torch.randn(2, 3, 8, 8)
    calls = []

    def spy(gm: fx.GraphModule) -> None:
        calls.append(gm)
        hardswish_as_formula(gm)

    door = torch.compile(model, backend="fusion_compiler", options={"passes": {"pre_fusion": spy}})
    torch.testing.assert_close(door(x), model(x), rtol=1e-5, atol=1e-6)
    assert calls


def test_a_failing_pass_stops_the_compile_naming_it():
    def broken(gm: fx.GraphModule) -> None:
        raise KeyError("no such node")

    compiled = fusion_compiler.compile(ConvHardswish(), passes={"pre_fusion": [broken]})
    with pytest.raises(FusionError, match=r"pre_fusion pass .*broken .*KeyError"):
        compiled(torch.randn(1, 3, 8, 8))
    returns_text = fusion_compiler.compile(ConvHardswish(),
                                           passes={"post_lowering": [lambda gm: "done"]})
    with pytest.raises(FusionError, match="returned str"):
        returns_text(torch.randn(1, 3, 8, 8))


def test_the_option_is_checked_when_given():
    with pytest.raises(ValueError, match="unknown pipeline 'fusion'"):
        CompileOptions(passes={"fusion": [hardswish_as_formula]})
    with pytest.raises(TypeError, match="is not callable"):
        CompileOptions(passes={"pre_fusion": ["hardswish_as_formula"]})
    with pytest.raises(TypeError, match="passes must map"):
        CompileOptions(passes=3)
    options = CompileOptions(passes={"pre_fusion": hardswish_as_formula})
    assert options.custom_passes("pre_fusion") == (hardswish_as_formula,)
    assert options.custom_passes("post_lowering") == ()
    hash(options)  # still a value: options are compared and hashed
    assert options.replace(autotune=1).passes == options.passes
