"""What a region's PyTorch ops are timed as while lowering chooses its backend
(``backends/glue_stand_in.py``), on the CPU: the convolution as it is, then one pointwise pass as
Inductor's fused epilogue, unless the glue runs eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fusion_compiler as fc
from fusion_compiler import CompileOptions
from fusion_compiler.backends.glue_stand_in import (eager_glue, pytorch_stand_in,
                                                    pytorch_timing_record, timed_as)
from fusion_compiler.lowering import regions_of
from conftest import CUDA_PIPELINE, FUSE_ALL


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    """conv > batch norm > residual add (the block's input) > ReLU."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


def _region(model, x):
    with torch.no_grad():
        gm = fc.compile(model.eval(), glue_backend=None, options=CUDA_PIPELINE,
                        backends=()).specialize(x).graph_module
    (region,) = regions_of(gm)
    return region


def _inputs(region):
    torch.manual_seed(0)
    return [torch.randn(ph.meta["val"].shape)
            for ph in region.graph_module.graph.find_nodes(op="placeholder")]


def _dispatched(run, inputs):
    with torch.no_grad(), _Ops() as ops:
        run(*inputs)
    return ops.ops


def test_a_residual_block_is_timed_as_its_convolution_and_one_pass_reading_the_residual():
    region = _region(_Block(), torch.randn(2, 8, 6, 6))
    assert region.pattern == "conv3x3 > add > mul > add > add > relu"
    inputs = _inputs(region)
    assert _dispatched(pytorch_stand_in(region), inputs) == [
        "aten.convolution.default", "aten.add.Tensor"]
    # eagerly, each op of the region is a pass of its own
    assert len(_dispatched(region.graph_module, inputs)) == 6


def test_the_stand_in_runs_the_regions_own_convolution():
    from fusion_compiler.backends.glue_stand_in import _up_to_conv

    region = _region(_Block(), torch.randn(2, 8, 6, 6))
    x, weight = _inputs(region)[:2]
    prefix = _up_to_conv(region.graph_module, region.conv)
    torch.testing.assert_close(prefix(x, weight, *_inputs(region)[2:]),
                               F.conv2d(x, weight, padding=1), rtol=0, atol=0)


def test_an_exit_reduction_adds_a_reduction_of_the_output():
    from examples.seresnet9_fixup import SEFixupBlock
    from fusion_compiler.compiler import CompiledModule

    compiled = CompiledModule(SEFixupBlock(8, 8, 1, reduction=4).eval(), backends=(), **FUSE_ALL)
    with torch.no_grad():
        region = compiled.specialize(torch.randn(2, 8, 4, 4)).regions[1]
    assert region.pattern == "[add] conv3x3 > mul > add + sum_hw"
    ops = _dispatched(pytorch_stand_in(region), _inputs(region))
    # the prologue's add (eagerly, as in the region), the convolution, the pass, the sum
    assert ops == ["aten.add.Tensor", "aten.convolution.default", "aten.relu.default",
                   "aten.sum.dim_IntList"]


def test_eager_glue_times_the_regions_own_ops_under_a_record_of_its_own():
    region = _region(_Block(), torch.randn(2, 8, 6, 6))
    assert timed_as() == "as compiled glue runs them"
    assert pytorch_timing_record() == "pytorch_timing_glue"
    with eager_glue():
        assert pytorch_stand_in(region) is region.graph_module
        assert timed_as() == "eager ops"
        assert pytorch_timing_record() == "pytorch_timing_paired"
    assert pytorch_timing_record() == "pytorch_timing_glue"


@pytest.mark.parametrize("options,training,compiled", [
    ({}, False, True), ({}, True, True), ({"cuda_graph": False}, False, False),
    ({"cuda_graph": False}, True, True), ({"glue_backend": None}, True, False),
    ({"glue_backend": "eager"}, False, False), ({"glue_backend": "aot_eager"}, False, False),
    ({"glue_backend": "inductor", "cuda_graph": False}, False, True)])
def test_the_options_say_whether_the_glue_is_expected_compiled(options, training, compiled,
                                                              monkeypatch):
    """As ``glue_backend`` decides on CUDA (made to look available here), before lowering:
    only Inductor fuses the ops after a convolution."""
    from fusion_compiler.passes.glue import choice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(choice, "inductor_reason", lambda: "")
    gm = torch.fx.symbolic_trace(nn.Conv2d(3, 8, 3))
    assert choice.glue_compiled_expected(CompileOptions(**options), gm, training) is compiled
    # without Triton (or an old GPU), "auto" runs eager glue
    monkeypatch.setattr(choice, "inductor_reason", lambda: "Triton does not import")
    assert choice.glue_compiled_expected(CompileOptions(**options), gm, training) is (
        compiled and options.get("glue_backend", "auto") != "auto")


def test_a_derived_backward_runs_regions_on_pytorch_ops_eagerly():
    from fusion_compiler.passes.glue import glue_compiled_expected
    from conftest import DERIVED_BACKWARD

    gm = torch.fx.symbolic_trace(nn.Conv2d(3, 8, 3))
    assert not glue_compiled_expected(DERIVED_BACKWARD, gm, True)
    assert glue_compiled_expected(CompileOptions(), gm, True)


def test_a_bare_convolution_is_timed_as_the_convolution_alone():
    region = _region(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False)), torch.randn(2, 3, 8, 8))
    assert region.pattern == "conv3x3"
    assert _dispatched(pytorch_stand_in(region), _inputs(region)) == ["aten.convolution.default"]


def test_a_cached_plan_not_yet_timed_against_the_ops_as_timed_now_needs_tuning(tmp_path):
    """``plan_work`` says ``"tune"`` for a cached cuDNN plan without a timing against the
    region's PyTorch ops under the name of how they are timed now (a cache from before, or for
    the other kind of glue), so tier 0's background lowering is not started for a "load" that
    times."""
    from fusion_compiler.backends.base import Support
    from fusion_compiler.backends.cudnn.backend import CudnnBackend
    from fusion_compiler.backends.cudnn.graph import region_recipe
    from fusion_compiler.backends.cudnn.recipe import recipe_key

    region = _region(_Block(), torch.randn(2, 8, 6, 6))
    backend = CudnnBackend(cache_dir=tmp_path, autotune=3)
    backend.supports = lambda region: Support(True)  # as on a GPU
    backend.device_fields = lambda device: {"gpu": "test"}
    recipe = region_recipe(region)
    assert backend._untimed_against_pytorch(region, recipe, cached=True)
    backend.cache.store_record(backend.header(recipe_key(recipe), None),
                               pytorch_timing_record(), {"cudnn_ms": 1.0, "pytorch_ms": 2.0})
    assert not backend._untimed_against_pytorch(region, recipe, cached=True)
    with eager_glue():  # stored for compiled glue: eager glue's timing is still missing
        assert backend._untimed_against_pytorch(region, recipe, cached=True)
    assert backend._untimed_against_pytorch(region, recipe, cached=False)  # no choice to follow
    assert not CudnnBackend(cache_dir=tmp_path, autotune=1)._untimed_against_pytorch(
        region, recipe, cached=True)  # nothing is timed with autotune 1


def test_a_cuda_region_on_pytorch_ops_is_inductors_work(monkeypatch):
    """A region left to PyTorch ops on CUDA is work for Inductor (its ops are traced into the
    glue, and lowering timed them as Inductor runs them); on the CPU, as a dump shows the CUDA
    pipeline's graph, regions are not."""
    from fusion_compiler.passes.glue import inductor_work, work

    with torch.no_grad():
        gm = fc.compile(_Block().eval(), glue_backend=None, options=CUDA_PIPELINE,
                        backends=()).specialize(torch.randn(2, 8, 6, 6)).graph_module
    (region,) = regions_of(gm)
    assert region.backend == "reference" and inductor_work(gm) == []
    monkeypatch.setattr(work, "node_device", lambda node: torch.device("cuda", 0))
    assert [gm.get_submodule(n.target) for n in inductor_work(gm)] == [region]


def test_a_bare_convolution_on_pytorch_ops_is_not_inductors_work(monkeypatch):
    """A region whose only op is its convolution gives Inductor nothing to fuse (it would only
    call PyTorch's convolution), so it does not make the glue Inductor's."""
    from fusion_compiler.passes.glue import inductor_work, work

    conv = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False).eval()
    with torch.no_grad():
        gm = fc.compile(conv, glue_backend=None, options=CUDA_PIPELINE,
                        backends=()).specialize(torch.randn(2, 8, 6, 6)).graph_module
    (region,) = regions_of(gm)
    monkeypatch.setattr(work, "node_device", lambda node: torch.device("cuda", 0))
    assert region.backend == "reference" and inductor_work(gm) == []
