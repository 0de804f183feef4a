"""Concurrent branches on the CPU: the fuse pass's branch rule and the side-stream schedule
(:mod:`fusion_compiler.runtime.streams`) as graph edits, with numerics and Inductor's order of the
compiled glue. tests/test_gpu_defaults.py runs the streams on the GPU."""

from __future__ import annotations

import operator
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.seresnet9_fixup import randomized_se_resnet9_fixup_depth
from fusion_compiler.capture import capture
from fusion_compiler.config import CompileOptions, Target
from fusion_compiler.ir.region import Lowering, called_region
from fusion_compiler.lowering import regions_of
from fusion_compiler.passes import PassManager, fusion, pre_fusion
from fusion_compiler.passes.post_lowering.streams import run_short_branches_beside
from fusion_compiler.runtime.region_op import register_kernel, run_region

JOIN = torch.ops.fusion_compiler.join_side_stream.default


def _fused(model: nn.Module, x: torch.Tensor, branches: bool):
    options = CompileOptions(concurrent_branches=branches, cuda_pipeline=True,
                             horizontal_fusion=False)
    target = Target(cuda=False)
    return PassManager([*pre_fusion(options, target), *fusion(options, target)], [x]).run(
        capture(model))


class _Opaque:
    """A region kernel called through ``run_region`` (opaque to tracing, like a cuDNN kernel)
    that ignores inputs past the region's own, as ``CudnnKernel`` does."""

    def __init__(self, region):
        self.region = region
        self.n = len(list(region.graph_module.graph.find_nodes(op="placeholder")))
        self.key = register_kernel(self, region.output_specs())
        self.beside = False

    def __call__(self, *inputs):
        return tuple(self.region.graph_module(*inputs[:self.n]))

    def call(self, *inputs):
        return tuple(run_region(self.key, list(inputs)))


def _scheduled(model: nn.Module, x: torch.Tensor):
    """``model`` fused with the branch rule, every region an :class:`_Opaque` kernel, then
    scheduled; returns the graph module, the side regions' ids and the kernels by region id."""
    gm = _fused(model, x, branches=True)
    kernels = {}
    for region in regions_of(gm):
        kernels[region.region_id] = _Opaque(region)
        region.set_lowering(Lowering("reference", "lowered", kernels[region.region_id].call))

    def mark(region):
        kernels[region.region_id].beside = True

    return gm, run_short_branches_beside(gm, eligible=lambda r: True, mark=mark), kernels


def test_the_join_of_a_downsample_branch_is_left_out_of_its_region():
    model = randomized_se_resnet9_fixup_depth().eval()
    x = torch.randn(2, 11, 64, 64)
    one_stream = [r.pattern for r in regions_of(_fused(model, x, branches=False))]
    gm = _fused(model, x, branches=True)
    two_streams = [r.pattern for r in regions_of(gm)]
    # layers 1-3: the downsample conv (AvgPool + 1x1 as a 3x3/s2 conv) took the residual add,
    # ReLU and the next block's bias; with the rule it is a bare convolution
    assert one_stream.count("conv3x3/s2 > add > relu > add") == 5
    assert two_streams.count("conv3x3/s2") == 3
    reasons = gm.meta["fusion_reasons"]
    joins = [name for name, why in reasons.items() if "joins a longer branch" in why]
    assert len(joins) == 3
    assert "this one 0.0189" in reasons[joins[0]]  # 2 * 128*8*8*2 * 64*9 FLOPs at N=2


class _Bottleneck(nn.Module):
    """torchvision's Bottleneck shape: the main path's last conv meets the downsample's."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(16, 8, 1)
        self.conv2 = nn.Conv2d(8, 8, 3, 2, 1)
        self.conv3 = nn.Conv2d(8, 32, 1)
        self.down = nn.Conv2d(16, 32, 1, 2)

    def forward(self, x):
        out = F.relu(self.conv2(F.relu(self.conv1(x))))
        out = self.conv3(out)
        return F.relu(out + self.down(x))


def test_a_bottleneck_joins_in_its_last_convolution_and_its_downsample_runs_beside():
    model = _Bottleneck().eval()
    x = torch.randn(2, 16, 8, 8)
    gm, beside, kernels = _scheduled(model, x)
    patterns = {r.region_id: r.pattern for r in regions_of(gm)}
    assert patterns == {"r0": "conv1x1 > add > relu", "r1": "conv3x3/s2 > add > relu",
                        "r2": "conv1x1/s2 > add", "r3": "conv1x1 > add > add > relu"}
    assert beside == ["r2"] and kernels["r2"].beside
    assert {r.region_id: r.stream for r in regions_of(gm)}["r2"] == "side"
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def _calls(gm):
    return {called_region(gm, n).region_id: n for n in gm.graph.nodes
            if called_region(gm, n) is not None}


def test_a_side_region_forks_before_the_other_branch_and_joins_after_its_last_region():
    model = randomized_se_resnet9_fixup_depth().eval()
    x = torch.randn(2, 11, 64, 64)
    gm, beside, _ = _scheduled(model, x)
    assert beside == ["r5", "r8", "r11"]  # the three downsample convolutions
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    calls = _calls(gm)
    joins = list(gm.graph.find_nodes(op="call_function", target=JOIN))
    assert len(joins) == 3
    for side, first, last, join in zip(("r5", "r8", "r11"), ("r3", "r6", "r9"),
                                       ("r4", "r7", "r10"), joins):
        outputs = [u for u in calls[side].users if u.target is operator.getitem]
        # forked before the other branch's first region, which takes its outputs to be ordered
        assert order[calls[side]] < order[calls[first]]
        assert calls[first].args[-len(outputs):] == tuple(outputs)
        # joined before anything reads them, after the other branch's last region
        joined, keep = join.args
        assert joined == outputs
        assert calls[first].args[0] in keep  # the fork's input stays alive until the join
        assert any(n.args[0] is calls[last] for n in keep if n.target is operator.getitem)
        readers = [r for o in outputs for r in o.users if r is not join
                   and r is not calls[first]]
        assert all(order[join] < order[r] for r in readers)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-4)


def test_inductor_keeps_the_fork_before_the_other_branch_and_the_join_after_it():
    """The order in the code Inductor generates for the glue (CPU): what the fork's extra
    readers and the join's inputs are for."""
    from torch._inductor.utils import run_and_get_code  # noqa: PLC0415

    model = randomized_se_resnet9_fixup_depth().eval()
    x = torch.randn(2, 11, 64, 64)
    gm, _, kernels = _scheduled(model, x)
    torch._dynamo.reset()
    with torch.no_grad():  # an inference specialization
        out, (code,) = run_and_get_code(torch.compile(gm, backend="inductor", fullgraph=True), x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    lines = code.splitlines()

    def line_of(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    def region(rid: str) -> int:
        return line_of(rf"run_region\.default\({kernels[rid].key}, ")

    joins = [i for i, line in enumerate(lines) if "join_side_stream.default(" in line]
    assert len(joins) == 3
    for side, first, last, join in zip(("r5", "r8", "r11"), ("r3", "r6", "r9"),
                                       ("r4", "r7", "r10"), joins):
        assert region(side) < region(first) < region(last) < join
    assert "clone" not in "".join(lines[i] for i in joins)


class _ThreeBranches(nn.Module):
    """An Inception-like fork into branches of one, two and three convolutions."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(16, 8, 1)
        self.b1, self.b2 = nn.Conv2d(16, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
        self.c1, self.c2, self.c3 = (nn.Conv2d(16, 8, 1), nn.Conv2d(8, 8, 3, padding=1),
                                     nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x):
        a = F.relu(self.a(x))
        b = F.relu(self.b2(F.relu(self.b1(x))))
        c = F.relu(self.c3(F.relu(self.c2(F.relu(self.c1(x))))))
        return torch.cat([a, b, c], 1)


def test_the_critical_path_stays_on_the_current_stream_and_the_rest_goes_beside():
    """The longest branch (three convolutions) stays; the other two go to the side stream, one
    join each, and a join that holds another side region's value is not taken for a reader."""
    model = _ThreeBranches().eval()
    x = torch.randn(2, 16, 8, 8)
    gm, beside, _ = _scheduled(model, x)
    patterns = {r.region_id: r.pattern for r in regions_of(gm)}
    assert [patterns[r] for r in beside] == ["conv1x1 > add > relu", "conv1x1 > add > relu",
                                             "conv3x3 > add > relu"]
    assert len(list(gm.graph.find_nodes(op="call_function", target=JOIN))) == 3
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
