"""Layout edits between regions (:mod:`fusion_compiler.runtime.layout`), checked on the CPU."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fusion_compiler.runtime.layout import nchw_padded_avg_pools


class Pools(nn.Module):
    def forward(self, x):
        return (F.avg_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 2, 2, 0),
                F.avg_pool2d(x, kernel_size=3, stride=2, padding=(0, 1)))


def test_only_padded_avg_pools_get_an_nchw_input():
    gm = fx.symbolic_trace(Pools())
    x = torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    want = gm(x)
    assert nchw_padded_avg_pools(gm) == 2
    pools = [n for n in gm.graph.nodes if n.target is F.avg_pool2d]
    fed = [n.args[0].target == "contiguous" if n.args else False for n in pools]
    assert fed == [True, False, True]
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
    assert nchw_padded_avg_pools(fx.symbolic_trace(nn.Conv2d(4, 4, 3))) == 0


class Stem(nn.Module):
    """A stem whose PyTorch-op output (the max pool) is read by two regions, and a region fed by
    the graph input: resnet's shape."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 1)
        self.b = nn.Conv2d(8, 16, 1)

    def forward(self, x):
        p = F.max_pool2d(torch.relu(self.stem(x)), 2)
        return torch.relu(self.a(p)).sum() + self.b(p).sum()


def test_region_activations_are_made_channels_last_once_where_they_are_made():
    import fusion_compiler as fc
    from fusion_compiler.region import Region
    from fusion_compiler.runtime.layout import channels_last_activations

    torch.manual_seed(0)
    spec = fc.compile(Stem().eval(), glue_backend=None).specialize(torch.randn(2, 3, 8, 8))
    gm = spec.graph_module
    regions = {n.name: gm.get_submodule(n.target) for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Region)}
    assert len(regions) == 3
    x = torch.randn(2, 3, 8, 8)
    want = gm(x)
    assert channels_last_activations(gm) == 0  # on the CPU no region asks for channels_last
    for region in regions.values():  # as the cuDNN kernels mark them: the image is input 0
        region.backend, region.nhwc_inputs = "cudnn", frozenset({0})
    assert channels_last_activations(gm) == 2  # the graph input and the max pool's output
    converts = [n for n in gm.graph.nodes if n.target == "contiguous"]
    assert [n.args[0].op for n in converts] == ["placeholder", "call_function"]
    assert all(n.kwargs["memory_format"] == torch.channels_last for n in converts)
    assert len(converts[1].users) == 2  # one conversion for both regions reading the pool
    # the stem region's output comes from cuDNN (already channels_last): not converted
    torch.testing.assert_close(gm(x), want)
