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
    # fp16: four reads in fp32 and two roundings per batch norm, three casts in all
    assert calls.count("to") == (3 if dtype == torch.float16 else 0), fx.GraphModule(gm, graph).code
    with torch.no_grad():
        want, got = gm(), fx.GraphModule(gm, graph)()
    assert len(want) == len(got) == 6
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def _traced(fn, *shapes_and_dtypes) -> fx.GraphModule:
    from torch.fx.passes.shape_prop import ShapeProp

    gm = fx.symbolic_trace(fn)
    args = [torch.ones(s, dtype=d) for s, d in shapes_and_dtypes]
    ShapeProp(gm).propagate(*args)
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if hasattr(meta, "shape"):  # a tensor's (not the output tuple's)
            node.meta["val"] = torch.empty(meta.shape, dtype=meta.dtype)
    return gm


def test_a_graph_with_nothing_to_batch_or_an_in_place_op_is_copied_as_it_is():
    for fn in (lambda x, y: torch.rsqrt(x + 1) * 2,
               lambda x, y: (x.add_(1) + 1, y + 1)):  # order matters: not reordered
        gm = _traced(fn, ((3,), torch.float32), ((3,), torch.float32))
        assert [n.name for n in batched(gm.graph).nodes] == [n.name for n in gm.graph.nodes]


def test_numbers_of_another_type_or_sign_are_not_one_group():
    """``a + 1`` (an int tensor stays int) and ``b + 1.0`` (becomes float); ``a * 0.0`` and
    ``b * -0.0`` (the sign of zero): one multi-tensor op each would change a result (found by a
    review, session 37)."""
    for fn, dtype in ((lambda a, b: (a + 1, b + 1.0), torch.int64),
                      (lambda a, b: (a * 0.0, b * -0.0), torch.float32)):
        gm = _traced(fn, ((3,), dtype), ((3,), dtype))
        a, b = torch.ones(3, dtype=dtype), torch.ones(3, dtype=dtype)
        want, got = gm(a, b), fx.GraphModule(gm, batched(gm.graph))(a, b)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g, w)
            assert torch.equal(torch.signbit(g.float()), torch.signbit(w.float()))


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


def test_casts_of_sources_of_other_dtypes_are_not_one_group():
    """An integer cast to fp32 beside fp16 casts to fp32: concatenated together, the integers
    would pass through fp16 (257 -> 256, 70000 -> inf; found by a review, session 42)."""
    def fn(i, h):
        return i.to(torch.float32), h.to(torch.float32)

    gm = _traced(fn, ((3,), torch.int32), ((3,), torch.float16))
    args = (torch.tensor([257, 4097, 70000], dtype=torch.int32),
            torch.tensor([1.5, 2.0, 3.0], dtype=torch.float16))
    want, got = gm(*args), fx.GraphModule(gm, batched(gm.graph))(*args)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)
