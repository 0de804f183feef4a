"""Derived tensors kept current by content (runtime/derive.py, runtime/derivations.py): the gather
algebra, the fingerprint-and-derive kernels under Triton's interpreter, and the translation of
hoisted graphs. The kernels' GPU runs: test_gpu_derive.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import CUDA_PIPELINE, run_interpreted

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.runtime.derive import Expr, NotDerivable, evaluate
from fusion_compiler.runtime.derivations import expressions
from test_fuse_patterns import _randomize_bn


def _sources():
    torch.manual_seed(0)
    return [torch.randn(8, 4, 3, 3).half(), torch.randn(8, 4, 1, 1).half(), torch.randn(1).half(),
            torch.randn(8)]


def test_rearrangements_products_and_scales_describe_what_torch_computes():
    w, ds, s, v = srcs = _sources()
    e = [Expr.source(i, t) for i, t in enumerate(srcs)]
    cases = [
        (Expr.rearranged(lambda a, b: torch.cat([a, b.expand(8, 4, 3, 3)], 0), e[0],
                         e[1].scaled(1 / 9)),
         torch.cat([w.float(), ds.float().expand(8, 4, 3, 3) / 9], 0)),
        (Expr.rearranged(lambda a: a.reshape(8, 36).t(), e[0]).times(e[2]),
         w.float().reshape(8, 36).t() * s.float()),
        (Expr.rearranged(lambda a: F.pad(a, (0, 0, 0, 0, 0, 4)), e[0]),
         F.pad(w.float(), (0, 0, 0, 0, 0, 4))),
        (Expr.rearranged(lambda a: a.reshape(1, 8, 1, 1).expand(2, 8, 5, 5), e[3]).scaled(-2.0),
         -2.0 * v.reshape(1, 8, 1, 1).expand(2, 8, 5, 5)),
        (Expr.constant(0.5, (3, 2)), torch.full((3, 2), 0.5)),
    ]
    for expr, want in cases:
        assert torch.allclose(evaluate(expr, srcs), want, rtol=1e-6, atol=1e-6)


def test_a_product_of_three_tensors_is_not_derivable():
    w, _, s, v = _sources()
    two = Expr.source(0, w.reshape(-1)[:8]).times(Expr.source(2, s))
    assert len(two.factors) == 2
    with pytest.raises(NotDerivable):
        two.times(Expr.source(3, v))


def test_hoisted_graphs_translate_their_rearrangements_and_leave_batch_norm_opaque():
    """SE-ResNet9's hoisted downsample weights (``w * 1/9`` expanded, concatenated with the first
    convolution's) are expressions; an eval batch norm's ``rsqrt`` makes its scale opaque."""
    for model, x, want_opaque in (
            (randomize_(se_resnet9_fixup(3)).eval(), torch.randn(2, 3, 64, 64), False),
            (_randomize_bn(nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, bias=False),
                                         nn.BatchNorm2d(16), nn.ReLU())).eval(),
             torch.randn(2, 8, 6, 6), True)):
        compiled = fc.compile(model, options=CUDA_PIPELINE)
        with torch.no_grad():
            compiled(x)
        hoisted = compiled.last.graph_module.meta["hoisted"]
        gm = hoisted.graph_module
        slots: list[torch.Tensor] = []

        def leaf(node):
            t = getattr(gm, node.target) if "." not in node.target else \
                gm.get_parameter(node.target) if node.target in dict(gm.named_parameters()) \
                else gm.get_buffer(node.target)
            slots.append(t)
            return Expr.source(len(slots) - 1, t)

        known = expressions(gm.graph, leaf)
        outs = list(gm.graph.find_nodes(op="output")[0].args[0])
        values = gm()
        for node, value in zip(outs, values):
            if node in known:
                assert torch.allclose(evaluate(known[node], slots), value.float(), rtol=1e-6)
        assert any(n not in known for n in outs) == want_opaque


_PROGRAM = r"""
import json, sys, torch, torch.nn.functional as F
from fusion_compiler.runtime import derive
derive.derive_reason = lambda device: ""  # the interpreter runs the kernels on CPU tensors
from fusion_compiler.runtime.derive import Expr, Program
torch.manual_seed(0)
w = torch.randn(8, 4, 3, 3).half(); ds = torch.randn(8, 4, 1, 1).half(); s = torch.randn(1).half()
srcs = [w, ds, s]
e = [Expr.source(i, t) for i, t in enumerate(srcs)]
cl = torch.empty_like(w, memory_format=torch.channels_last)
cat = torch.empty(16, 4, 3, 3, dtype=torch.half).contiguous(memory_format=torch.channels_last)
dense = torch.empty(36, 8, dtype=torch.half)
pad = torch.empty(8, 8, 3, 3, dtype=torch.half)
prog = Program(srcs, [
    (cl, e[0]),
    (cat, Expr.rearranged(lambda a, b: torch.cat([a, b.expand(8, 4, 3, 3)], 0), e[0], e[1].scaled(1 / 9))),
    (dense, Expr.rearranged(lambda a: a.reshape(8, 36).t(), e[0]).times(e[2])),
    (pad, Expr.rearranged(lambda a: F.pad(a, (0, 0, 0, 0, 0, 4)), e[0]))])
def right():
    want = [w, torch.cat([w, (ds.float() / 9).half().expand(8, 4, 3, 3)], 0),
            (w.reshape(8, 36).t().float() * s.float()).half(), F.pad(w, (0, 0, 0, 0, 0, 4))]
    return [bool(torch.allclose(d.float(), x.float(), rtol=1e-3, atol=1e-3))
            for d, x in zip((cl, cat, dense, pad), want)]
out = {}
prog.run(); out["first"] = right()
cl.zero_(); prog.run(); out["untouched"] = bool((cl == 0).all())  # no source changed
cl.copy_(w)
w.data.mul_(2); prog.run(); out["data"] = right()
opt_w = torch.nn.Parameter(w.data.float())
with torch.no_grad():
    w.data.copy_(w * -1)  # what a fused optimizer step does: no version change
prog.run(); out["copy"] = right()
s.data.fill_(3); prog.run(); out["scalar"] = right()
ds.data.add_(1); prog.run(); out["downsample"] = right()
print(json.dumps(out))
"""


def test_the_program_rewrites_what_changed_and_only_that_under_the_interpreter():
    """Writes that no version counter records (``.data``, a copy under ``no_grad`` through a
    detached alias) are seen; a derived tensor whose sources did not change is not rewritten
    (proof: a zeroed one stays zero)."""
    out = run_interpreted(_PROGRAM, {})
    assert out["untouched"]
    for step in ("first", "data", "copy", "scalar", "downsample"):
        assert all(out[step]), (step, out[step])


_DERIVATIONS = r"""
import json, sys, torch
from fusion_compiler.runtime import derive
derive.derive_reason = lambda device: ""
import fusion_compiler as fc
from fusion_compiler.runtime import derivations as module
from fusion_compiler.runtime.derivations import Derivations
from fusion_compiler.runtime.weight_cache import WeightCache, derivation_scope
module.EARLY_ELEMENTS = 0  # all fingerprinted (the small model's weights would all be "early")
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
model = randomize_(se_resnet9_fixup(3, base_planes=8)).eval()
compiled = fc.compile(model, options=fc.CompileOptions().internal(cuda_pipeline=True))
x = torch.randn(2, 3, 64, 64)
with torch.no_grad():
    compiled(x)
gm = compiled.last.graph_module
hoisted = gm.meta["hoisted"]
state = [*model.parameters(), *model.buffers(), *gm.buffers()]
d = Derivations(state, hoisted)
caches = {name: WeightCache() for name in ("conv2", "merged")}
weights = lambda: {"conv2": model.layer2.conv2.weight, "merged": getattr(gm, hoisted.names[1])}
def forward():  # what kernels do at each call: their caches, in the scope
    with derivation_scope(d):
        return {k: caches[k](w) for k, w in weights().items()}
held = forward()  # the warm-up call records them
d.build()
def right():
    d.prologue()
    hoisted_now = hoisted.graph_module()
    ok = [bool(torch.equal(getattr(gm, n), v)) for n, v in zip(hoisted.names, hoisted_now)]
    ok.append(bool(torch.equal(held["conv2"], model.layer2.conv2.weight)))
    ok.append(bool(torch.equal(held["merged"], hoisted_now[1])))
    return ok
out = {"first": right(), "program": d.program is not None and not d.program.reason,
       "same": forward()["conv2"] is held["conv2"]}
model.layer2.downsample[1].weight.data.mul_(-2)
model.layer2.conv2.weight.data.add_(1)
out["data"] = right()
held["conv2"].zero_()
out["untouched"] = (d.prologue(), bool((held["conv2"] == 0).all()))[1]
print(json.dumps(out))
"""


def test_derivations_record_kernels_values_and_translate_hoisted_ones_under_the_interpreter():
    """A kernel's weight copy recorded in the scope is a persistent tensor the prologue rewrites
    when (and only when) its weight changes; so are the hoisted values (SE-ResNet9's merged
    downsample weights), followed through a ``.data`` write."""
    out = run_interpreted(_DERIVATIONS, {})
    assert out["program"] and out["same"] and out["untouched"]
    assert all(out["first"]) and all(out["data"]), out


def test_a_failed_join_still_forgets_the_captures_event(monkeypatch):
    """In a capture that failed, the join at the forward's end raises; the event it waited for
    belongs to no graph, so it must be forgotten anyway (a later eager call that joined it
    raised "CUDA error: invalid argument")."""
    from fusion_compiler.runtime.derivations import Derivations

    derivations = Derivations([])
    derivations._ready, derivations._side = object(), object()

    def failed_join():
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(derivations, "join", failed_join)
    with pytest.raises(RuntimeError, match="previous error"):
        derivations.finish()
    assert derivations._ready is None and derivations._side is None
