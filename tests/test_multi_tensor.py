"""Multi-tensor batching of the hoisted values a CUDA graph recomputes at every replay
(runtime/multi_tensor.py, run by runtime/derivations.py): every
batch norm's folded scale and shift in six multi-tensor ops, not six ops per batch norm, with the
values the unbatched graph computes."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from conftest import CUDA_PIPELINE, run_interpreted

import fusion_compiler as fc
from fusion_compiler.runtime.multi_tensor import batched
from test_fuse_patterns import _randomize_bn


def _bn_net() -> nn.Module:
    layers = []
    for cin, cout in ((3, 8), (8, 16), (16, 16)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return _randomize_bn(nn.Sequential(*layers)).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_batch_norms_fold_is_one_multi_tensor_op_per_step_with_the_same_values(dtype):
    model = _bn_net().to(dtype)
    compiled = fc.compile(model, options=CUDA_PIPELINE)
    with torch.no_grad():
        compiled(torch.randn(2, 3, 8, 8, dtype=dtype))
    hoisted = compiled.last.graph_module.meta["hoisted"]
    gm = hoisted.graph_module
    rsqrts = [n for n in gm.graph.nodes if n.target is torch.rsqrt]
    assert len(rsqrts) == 3, gm.code
    graph = batched(gm.graph)
    calls = [n.target for n in graph.nodes if n.op in ("call_function", "call_method")
             and n.target is not operator.getitem]
    foreach = [t for t in calls if getattr(t, "__name__", "").startswith("_foreach_")]
    assert len(foreach) == 6 and torch.rsqrt not in calls, fx.GraphModule(gm, graph).code
    with torch.no_grad():
        want, got = gm(), fx.GraphModule(gm, graph)()
    assert len(want) == len(got) == 6
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_a_graph_with_nothing_to_batch_is_copied_as_it_is():
    graph = fx.symbolic_trace(lambda x: torch.rsqrt(x + 1) * 2).graph
    for node in graph.nodes:
        node.meta["val"] = torch.ones(3)
    copy = batched(graph)
    assert [n.target for n in copy.nodes] == [n.target for n in graph.nodes]


_OPAQUE = r"""
import json, torch
from fusion_compiler.runtime import derive
derive.derive_reason = lambda device: ""
import fusion_compiler as fc
from fusion_compiler.runtime.derivations import Derivations
import sys; sys.path.insert(0, "tests")
from test_multi_tensor import _bn_net
model = _bn_net()
compiled = fc.compile(model, options=fc.CompileOptions().internal(cuda_pipeline=True))
with torch.no_grad():
    compiled(torch.randn(2, 3, 8, 8))
gm = compiled.last.graph_module
hoisted = gm.meta["hoisted"]
d = Derivations([*model.parameters(), *model.buffers(), *gm.buffers()], hoisted)
d.build()
def right():
    d.prologue()
    with torch.no_grad():
        want = hoisted.graph_module()
    return [bool(torch.equal(getattr(gm, n), v)) for n, v in zip(hoisted.names, want)]
out = {"notes": d.notes, "first": right()}
model[1].running_var.data.mul_(3)  # no version counter moves
model[4].weight.data.add_(1)
for name in hoisted.names:
    getattr(gm, name).zero_()
out["changed"] = right()
print(json.dumps(out))
"""


def test_the_prologue_recomputes_the_batched_values_from_the_current_statistics():
    """The batch norms' folded values (opaque to the gather algebra) follow a ``.data`` write of
    their statistics and weights, computed by the batched graph in the prologue."""
    out = run_interpreted(_OPAQUE, {})
    assert any("6 hoisted value(s)" in n for n in out["notes"]), out
    assert all(out["first"]) and all(out["changed"]) and len(out["first"]) == 6, out
