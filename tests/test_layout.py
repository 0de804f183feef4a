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
