"""The autocast pass on the CPU (bf16): outputs keep eager autocast's dtypes whatever op ends the
graph, and ops called with keyword arguments are followed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fusion_compiler as fc
from conftest import rel_err


class _BiasedTail(nn.Module):
    """``conv(x) + fp32 bias`` (fp32 under eager autocast: type promotion), then ``tail``."""

    def __init__(self, tail: str):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bias = nn.Parameter(torch.randn(1, 4, 1, 1))
        self.tail = tail

    def forward(self, x):
        y = self.conv(x) + self.bias
        if self.tail == "flatten_method":
            return y.flatten(1)
        if self.tail == "transpose_method":
            return y.transpose(2, 3)
        if self.tail == "transpose_function":
            return torch.transpose(y, 2, 3)
        if self.tail == "mean_method":
            return y.mean((2, 3))
        if self.tail == "transpose_keywords":
            return torch.transpose(input=y, dim0=2, dim1=3)
        return y


@pytest.mark.parametrize("tail", ["plain", "flatten_method", "transpose_method",
                                  "transpose_function", "mean_method", "transpose_keywords"])
def test_outputs_have_eager_autocasts_dtype_whatever_op_ends_the_graph(tail):
    """The pass casts the Fixup-style bias to bf16 so the add stays in the region; each output is
    cast back to the dtype eager autocast returns (fp32 here), also after an op the pass does not
    track (a method, ``mean``) or one called with keyword arguments (which once raised)."""
    torch.manual_seed(0)
    model, x = _BiasedTail(tail).eval(), torch.randn(2, 4, 8, 8)
    compiled = fc.compile(model, cache_dir=False)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got, eager = compiled(x), model(x)
    with torch.no_grad():
        reference = model(x)
    assert got.dtype == eager.dtype == torch.float32
    # the pass keeps the add (and here the mean) in bf16 where eager promotes to fp32: within
    # bf16's rounding (unit roundoff 2**-8) of the fp32 module, not within eager's error
    assert rel_err(got, reference) < 1e-2


def test_cumulative_batch_norm_trains_under_autocast():
    """``BatchNorm2d(momentum=None)`` in training mode under autocast: shapes are propagated with
    fake tensors, and the module reads ``float(num_batches_tracked)``, which a fake tensor has no
    value for (the call was refused with "cannot run on inputs that eager PyTorch takes"). Output
    and running statistics within bf16's rounding of the fp32 module; the count exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None),
                          nn.ReLU()).train()
    reference = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None),
                              nn.ReLU()).train()
    reference.load_state_dict(model.state_dict())
    compiled = fc.compile(model, cache_dir=False)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            got = compiled(x)
        with torch.no_grad():
            want = reference(x)
        assert rel_err(got, want) < 2e-2
    bn, ref_bn = model[1], reference[1]
    assert int(bn.num_batches_tracked) == int(ref_bn.num_batches_tracked) == 3
    assert rel_err(bn.running_mean, ref_bn.running_mean) < 2e-2
    assert rel_err(bn.running_var, ref_bn.running_var) < 2e-2


class _Fp32Block(nn.Module):
    """A block kept in fp32 under the caller's autocast (``autocast(enabled=False)`` inside
    forward), then a cancellation that needs fp32."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            z = self.conv(x + 1000.0)
        return z - z.mean((2, 3), keepdim=True)


def test_an_autocast_block_in_forward_is_refused_by_compile_and_kept_by_the_door():
    """fx records no context manager: the block's ops were traced in the caller's autocast
    state (bf16 output where eager's is fp32, relative error 1.2). ``compile`` refuses the
    model in one line; the Dynamo door keeps the block."""
    torch.manual_seed(0)
    model = _Fp32Block()
    with pytest.raises(fc.FusionError, match="enters torch.autocast"):
        fc.compile(model, cache_dir=False)
    torch._dynamo.reset()
    door = torch.compile(model, backend="fusion_compiler", options={"cache_dir": False})
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got, want = door(x), model(x)
    assert got.dtype == want.dtype == torch.float32
    assert rel_err(got, want) < 1e-3  # fp32 rounding of values near 1000, then cancelled


class _Bf16Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = self.conv(x)
        return z * 2


def test_a_graph_entering_autocast_runs_as_its_ops_through_the_door():
    """A Dynamo graph holding a forward's autocast block, called without autocast: eager
    returns bf16; the graph's conv bias made an add returned fp32. Such a graph runs as its own
    ops (with one WARNING per process), with eager's dtype and values."""
    torch.manual_seed(0)
    model = _Bf16Block()
    torch._dynamo.reset()
    door = torch.compile(model, backend="fusion_compiler", options={"cache_dir": False})
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        got, want = door(x), model(x)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
