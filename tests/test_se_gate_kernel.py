"""The Triton kernel behind ``se_gate`` and ``se_scale`` (``kernels/se_gate.py``) on the CPU, under
Triton's interpreter: each gate kind (sigmoid, hard sigmoid) and hidden activation against the
fp64 formula. tests/test_gpu_se_gate.py runs the compiled kernel on a GPU."""

from __future__ import annotations

import pytest

from conftest import run_interpreted

_SCRIPT = r"""
import json, sys
import torch
from fusion_compiler.kernels import se_gate as k

k._sm_count = lambda device: 132  # no GPU to ask
kernel = k._triton_kernel()
assert kernel is not None
out = {}
for case in json.loads(sys.argv[1]):
    n, c, h, w, r, act, gate, scale = case
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w).contiguous(memory_format=torch.channels_last)
    w1, w2 = torch.randn(r, c) / c ** 0.5, torch.randn(c, r) / r ** 0.5
    b1, b2 = torch.randn(r), torch.linspace(-5, 5, c)  # gates on both sides of the hard clamp
    residual = torch.randn(n, c, h, w) if scale else None
    args = (x, w1, b1, w2, b2, act)
    got = k._launch(kernel, *args, scale, residual, scale, None, gate)
    d = lambda t: None if t is None else t.double()
    if scale:
        want = k.se_scale_reference(*(d(a) for a in args[:5]), act, d(residual), True, None, gate)
    else:
        want = k.se_gate_reference(*(d(a) for a in args[:5]), act, gate=gate)
    out[json.dumps(case)] = (got.double() - want).abs().max().item() / want.abs().max().item()
print(json.dumps(out))
"""


@pytest.mark.parametrize("scale", [False, True])
def test_the_kernel_computes_each_gate_kind_as_the_formula(scale):
    cases = [[3, 24, 5, 7, 6, act, gate, scale] for act in ("relu", "silu")
             for gate in ("sigmoid", "hardsigmoid")]
    errors = run_interpreted(_SCRIPT, cases)
    assert len(errors) == len(cases)
    for case, err in errors.items():
        assert err < 1e-5, (case, err)


_WIDE_OUTPUT = r"""
import json, sys
import torch
from fusion_compiler.kernels import se_gate as k

k._sm_count = lambda device: 132
kernel = k._triton_kernel()
torch.manual_seed(0)
x = torch.randn(3, 24, 5, 7).half().contiguous(memory_format=torch.channels_last)
w1, w2 = (torch.randn(6, 24) / 24 ** 0.5).half(), (torch.randn(24, 6) / 6 ** 0.5).half()
b1, b2 = torch.randn(6).half(), torch.randn(24).half()
residual, bias = torch.randn(3, 24, 5, 7).half(), torch.full((1,), 0.3)
got = k._launch(kernel, x, w1, b1, w2, b2, "relu", True, residual, True, bias, "sigmoid",
                torch.float32)
d = lambda t: t.double()
want = k.se_scale_reference(d(x), d(w1), d(b1), d(w2), d(b2), "relu", d(residual), True,
                            d(bias), dtype=torch.float64)
print(json.dumps({"dtype": str(got.dtype), "channels_last": got.is_contiguous(
    memory_format=torch.channels_last), "error": ((got.double() - want).abs().max()
                                               / want.abs().max()).item()}))
"""


def test_the_scale_kernel_writes_the_dtype_a_graph_casts_its_output_to():
    """fp16 activations and weights, the block's tail, an fp32 result (the autocast pass's cast
    of the output, taken by the kernel): fp32 values, not fp16 ones cast up."""
    out = run_interpreted(_WIDE_OUTPUT, {})
    assert out["dtype"] == "torch.float32" and out["channels_last"]
    assert out["error"] < 1e-6, out
