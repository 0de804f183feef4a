"""The glue rewrites for Inductor (``passes/glue.py``), on the CPU."""

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fusion_compiler.passes.glue import MAX_WEIGHT, small_linears_as_reductions


class _SE(nn.Module):
    def __init__(self, c=64, r=16, classes=None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, c // r), nn.Linear(c // r, c, bias=False)
        self.head = nn.Linear(c, classes) if classes else None

    def forward(self, x):
        s = x.mean((2, 3))
        g = torch.sigmoid(self.fc2(torch.relu(self.fc1(s))))
        y = x * g[:, :, None, None]
        return (y, self.head(s)) if self.head is not None else y


def _traced(model, x):
    gm = fx.symbolic_trace(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(x))
    return gm


def test_small_linears_become_reductions_with_the_same_result():
    torch.manual_seed(0)
    model, x = _SE(), torch.randn(8, 64, 5, 5) + 0.5
    gm = _traced(model, x)
    assert small_linears_as_reductions(gm) == 2
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_large_linear_stays_a_matmul():
    model = _SE(c=64, classes=MAX_WEIGHT // 64 + 1)  # the head's weight is over the limit
    x = torch.randn(4, 64, 3, 3)
    gm = _traced(model, x)
    assert small_linears_as_reductions(gm) == 2
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["head"]
    for got, want in zip(gm(x), model(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
