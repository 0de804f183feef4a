"""The SpaceToDepth stems on the CPU: which regions the fusion pass ``space_to_depth_stem`` gives
the SpaceToDepth, the graph it leaves, the ``triton`` backend's kernel (numerics through the op's
torch-ops path, with the backend's CUDA check lifted), the op's fake (channels_last) outputs, and
the Triton kernel under Triton's interpreter. tests/test_gpu_space_to_depth.py runs the Triton
kernel on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from examples.seresnet9_fixup import SpaceToDepth, randomized_se_resnet9_fixup_depth
from fusion_compiler.backends import triton_stem
from fusion_compiler.capture import capture
from fusion_compiler.config import CompileOptions, Target
from fusion_compiler.kernels.space_to_depth import (OP, space_to_depth_conv,
                                                    space_to_depth_conv_reference)
from fusion_compiler.lowering import lower, regions_of
from fusion_compiler.passes import PassManager, fusion, pre_fusion
from fusion_compiler.passes.fusion.space_to_depth_stem import space_to_depth_stems
from fusion_compiler.passes.pre_fusion.rewrites import space_to_depth_source
from conftest import rel_err, run_interpreted

DT = torch.bfloat16  # the kernel's dtypes are fp16 and bf16; CPU convolutions take bf16


def _passes(cuda_form: bool, fuse: bool = True):
    """The pre-fusion and fusion pipelines (``cuda_form``: with the rewrite to the NHWC copy that
    CUDA specializations get; ``fuse``: the fusion pipeline too), for CPU inputs."""
    options, target = CompileOptions().internal(cuda_pipeline=cuda_form), Target(cuda=False)
    return [*pre_fusion(options, target), *(fusion(options, target) if fuse else [])]


def _fused(model: nn.Module, x: torch.Tensor, cuda_form: bool):
    """``model`` through the pre-fusion and fusion pipelines."""
    return PassManager(_passes(cuda_form), [x]).run(capture(model))


@pytest.fixture
def triton_stems_on_cpu(monkeypatch):
    """The ``triton`` backend takes stem regions on the CPU too (its op then runs torch ops)."""
    monkeypatch.setattr(triton_stem, "triton_reason", lambda: "")


def _stems(gm) -> list[str]:
    """Run the fusion pass ``space_to_depth_stem`` on ``gm``; the regions it gave a SpaceToDepth,
    then lower ``gm`` with the default backends."""
    space_to_depth_stems(gm)
    lower(gm, CompileOptions())
    return [r.region_id for r in regions_of(gm) if r.space_to_depth]


@pytest.mark.parametrize("cuda_form", [False, True])
def test_depth_stem_becomes_one_op_reading_the_image(cuda_form, triton_stems_on_cpu):
    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup_depth().to(DT).eval()
    x = torch.randn(2, 11, 64, 64, dtype=DT)
    plain = lower(_fused(model, x, cuda_form), CompileOptions(backends=()))
    gm = _fused(model, x, cuda_form)
    with torch.no_grad():
        before = plain(x)
        assert _stems(gm) == ["r0"]
        after = gm(x)
        want = model.float()(x.float())
    stem = regions_of(gm)[0]
    assert stem.backend == "triton_stem" and stem.status == "lowered"
    assert stem.pattern == "[space_to_depth4] conv1x1 > relu > add"
    assert stem.cudnn_graph is None and "Triton" in stem.plan
    assert all(r.backend == "reference" for r in regions_of(gm)[1:])  # no CUDA here
    # the region reads the image itself; no SpaceToDepth node is left in the outer graph
    call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "region_0")
    assert call.args[0].op == "placeholder"
    before_call = list(gm.graph.nodes)[:list(gm.graph.nodes).index(call)]
    assert all(n.op in ("placeholder", "get_attr") for n in before_call)
    # its graph module is still the region's exact semantics (tier 0 and checks run it)
    ph = next(iter(stem.graph_module.graph.find_nodes(op="placeholder")))
    assert tuple(ph.meta["val"].shape) == (2, 11, 64, 64)
    # the network's output, against fp32, beside the unedited graph's
    assert rel_err(after.float(), want) < 2e-2 and rel_err(before.float(), want) < 2e-2


@pytest.mark.parametrize("cuda_form,length", [(False, 3), (True, 4)])
def test_recognizes_both_forms_and_nothing_else(cuda_form, length):
    """The model's own SpaceToDepth (view, permute, reshape) and the rewrite's NHWC copy (view,
    permute, reshape, permute), each read by the 1x1 conv; nothing in a graph without one."""
    x = torch.randn(2, 3, 32, 64, dtype=DT)
    gm = PassManager(_passes(cuda_form, fuse=False), [x]).run(capture(_Stem("relu").to(DT).eval()))
    conv = next(n for n in gm.graph.nodes if n.target is torch.conv2d)
    found = space_to_depth_source(conv.args[0])
    assert found is not None
    source, block, chain = found
    assert (source.op, block, len(chain), chain[-1]) == ("placeholder", 4, length, conv.args[0])
    plain = capture(nn.Sequential(nn.ReLU()))
    assert all(space_to_depth_source(n) is None for n in plain.graph.nodes)


class _Stem(nn.Module):
    """SpaceToDepth(4), 1x1 conv, then an epilogue the kernel may or may not take."""

    def __init__(self, epilogue: str, channels: int = 3, out: int = 32):
        super().__init__()
        self.s2d = SpaceToDepth(4)
        self.conv = nn.Conv2d(16 * channels, out, 1, bias=True)
        self.scale = nn.Parameter(torch.rand(1, out, 1, 1) + 0.5)
        self.epilogue = epilogue

    def forward(self, x):
        y = self.conv(self.s2d(x))
        if self.epilogue == "sigmoid_scale":
            return torch.sigmoid(y) * self.scale - 0.25
        if self.epilogue == "tanh_two_outputs":
            t = torch.tanh(y / 2.0)
            return t, t * self.scale
        if self.epilogue == "residual":  # the add reads two outputs: it stays outside
            return torch.relu(y) + y.flip(0)
        if self.epilogue == "clipped":  # clamp: not an op the kernel runs
            return torch.clamp(y, 0.0, 6.0)
        return torch.relu(y)


@pytest.mark.parametrize("epilogue,taken", [("relu", True), ("sigmoid_scale", True),
                                            ("tanh_two_outputs", True), ("residual", True),
                                            ("clipped", False)])
def test_epilogues_the_kernel_takes(epilogue, taken, triton_stems_on_cpu):
    torch.manual_seed(1)
    model = _Stem(epilogue).to(DT).eval()
    x = torch.randn(3, 3, 32, 64, dtype=DT)
    gm = _fused(model, x, cuda_form=True)
    with torch.no_grad():
        assert _stems(gm) == (["r0"] if taken else [])
        assert [r.backend for r in regions_of(gm)][:1] == ["triton_stem" if taken else "reference"]
        got = gm(x)
        want = model.float()(x.float())
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        assert rel_err(g.float(), w) < 2e-2


def test_the_stem_under_autocast_takes_the_image_cast_along(triton_stems_on_cpu):
    """Under ``torch.autocast`` an fp32 model's stem convolution reads the autocast pass's cast
    of the SpaceToDepth to the weight's dtype: the region takes the cast along (the kernel rounds
    the fp32 image as it loads it), returns the weight's dtype as eager autocast does, within
    eager's error of fp64."""
    torch.manual_seed(4)
    model, x = _Stem("relu").eval(), torch.randn(2, 3, 32, 64)
    options = CompileOptions().internal(cuda_pipeline=True)
    target = Target(cuda=False, autocast=DT)
    with torch.autocast("cpu", DT), torch.no_grad():
        gm = PassManager([*pre_fusion(options, target), *fusion(options, target)], [x]).run(
            capture(model))
        assert _stems(gm) == ["r0"]
        got, eager = gm(x), model(x)
    stem = regions_of(gm)[0]
    assert stem.backend == "triton_stem" and stem.pattern.startswith("[space_to_depth4]")
    assert stem.conv_input_placeholder.meta["val"].dtype == torch.float32  # the image itself
    assert got.dtype == eager.dtype == DT
    want = model.double()(x.double())
    assert rel_err(got, want) <= 1.5 * rel_err(eager, want) + 1e-3


def _autocast_stem_graph(model: nn.Module, x: torch.Tensor):
    """``model`` through the CUDA-form pre-fusion and fusion pipelines under autocast (bf16)."""
    options = CompileOptions().internal(cuda_pipeline=True)
    target = Target(cuda=False, autocast=DT)
    with torch.autocast("cpu", DT), torch.no_grad():
        return PassManager([*pre_fusion(options, target), *fusion(options, target)], [x]).run(
            capture(model))


def _drops_numbers(monkeypatch):
    """``FakeTensorProp`` as in torch 2.11, where a node whose value is a Python number or a size
    (``x.shape``, its items, ``h // 4``) gets no ``meta["val"]``."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    original = FakeTensorProp.run_node

    def run_node(self, n):
        result = original(self, n)
        if not isinstance(result, torch.Tensor) and not isinstance(n.meta.get("val"),
                                                                  torch.Tensor):
            n.meta.pop("val", None)
        return result
    monkeypatch.setattr(FakeTensorProp, "run_node", run_node)


def test_autocast_propagation_keeps_shape_arithmetic_so_the_stem_is_taken(
        triton_stems_on_cpu, monkeypatch):
    """Shape propagation under autocast (fake tensors) records the numbers of ``x.shape`` even
    where ``FakeTensorProp`` drops them (torch 2.11): ``normalize`` makes the SpaceToDepth's
    ``view`` read constants, and the stem region takes it (on the H200 a missing value left
    ``x.view(getitem, ...)`` and the pass raised ``KeyError: getitem``)."""
    _drops_numbers(monkeypatch)
    torch.manual_seed(4)
    gm = _autocast_stem_graph(_Stem("relu").eval(), torch.randn(2, 3, 32, 64))
    assert not [n for n in gm.graph.nodes if n.target is getattr]  # no x.shape left
    assert _stems(gm) == ["r0"]


def test_a_stem_whose_shape_is_computed_in_the_graph_stays_as_it_is(triton_stems_on_cpu,
                                                                    monkeypatch, caplog):
    """A SpaceToDepth whose ``view`` reads sizes computed by other nodes of the graph is left
    outside the region, with the reason logged, rather than copied without them."""
    from fusion_compiler import shapes
    _drops_numbers(monkeypatch)
    monkeypatch.setattr(shapes, "_plain_number", lambda value: False)
    torch.manual_seed(4)
    gm = _autocast_stem_graph(_Stem("relu").eval(), torch.randn(2, 3, 32, 64))
    with caplog.at_level("INFO", logger="fusion_compiler"):
        assert _stems(gm) == []
    assert "its shape is computed by floordiv, floordiv_1, getitem" in caplog.text


def test_shapes_the_kernel_does_not_take_stay():
    torch.manual_seed(2)
    for model, x in [(_Stem("relu", out=24).to(DT).eval(), torch.randn(2, 3, 32, 64, dtype=DT)),
                     (_Stem("relu").eval(), torch.randn(2, 3, 32, 64)),  # fp32
                     (_Stem("relu").to(DT).eval(), torch.randn(2, 3, 32, 48, dtype=DT))]:
        gm = _fused(model, x, cuda_form=True)
        assert _stems(gm) == []
        assert all(r.backend == "reference" for r in regions_of(gm))


def test_op_reference_and_fake_outputs():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 16, 64, dtype=DT)
    w = torch.randn(32, 48, 1, 1, dtype=DT) * 0.2
    b = torch.randn(1, 32, 1, 1, dtype=DT)
    got = space_to_depth_conv(x, w, [b, torch.tensor([0.5])], [1, 5, 3], [0, 3], 4)
    s2d = SpaceToDepth(4)(x.double())
    y0 = torch.nn.functional.conv2d(s2d, w.double())
    y3 = torch.relu(y0 + b.double()) * 0.5
    assert len(got) == 2 and all(g.is_contiguous(memory_format=torch.channels_last) for g in got)
    assert rel_err(got[0].double(), y0) < 1e-2 and rel_err(got[1].double(), y3) < 1e-2
    ref = space_to_depth_conv_reference(x.double(), w.double(), [b.double(), torch.tensor(
        [0.5], dtype=torch.float64)], [1, 5, 3], [3], 4)[0]
    torch.testing.assert_close(ref, y3)
    with FakeTensorMode() as mode:
        fx_, fw = mode.from_tensor(x), mode.from_tensor(w)
        outs = OP(fx_, fw, [], [5], [1], 4)
    assert outs[0].shape == (2, 32, 4, 16)
    assert outs[0].stride() == (32 * 4 * 16, 1, 16 * 32, 32)
    with pytest.raises(ValueError, match="at most"):
        space_to_depth_conv(x, w, [], [5] * 5, [0], 4)


_INTERPRETED = """
import json, sys
import torch
from fusion_compiler.kernels import space_to_depth as s2d
from fusion_compiler.kernels.space_to_depth_triton import space_to_depth_conv_kernel

results = {}
for name, (n, c, h, w, k, image) in json.loads(sys.argv[1]).items():
    torch.manual_seed(0)
    x = torch.randn(n, c, h, w).to(getattr(torch, image))
    weight = (torch.randn(k, 16 * c, 1, 1) / (16 * c) ** 0.5).half()
    bias = torch.rand(1, k, 1, 1).half()
    got = s2d._launch(space_to_depth_conv_kernel, x, weight, [bias], [5, 1], [1, 2], 4)
    want = s2d.space_to_depth_conv_reference(x.double(), weight.double(), [bias.double()],
                                             [5, 1], [1, 2], 4)
    results[name] = [((g.double() - e).abs().max() / e.abs().max()).item()
                     for g, e in zip(got, want)]
print(json.dumps(results))
"""

STEM_CASES = {  # N, C, H, W, K, the image's dtype (the weight is fp16)
    "depth-like: 11 channels in one step (16, 5 masked)": (2, 11, 16, 64, 16, "float16"),
    "RGB-like: 3 channels in one step (4, 1 masked)": (2, 3, 16, 32, 32, "float16"),
    "one channel": (1, 1, 16, 16, 16, "float16"),
    "a wide image: 11 channels in steps of 8 (the second ragged)": (1, 11, 8, 512, 16, "float16"),
    "an fp32 image (autocast): rounded as it is loaded": (2, 3, 16, 32, 32, "float32"),
}


def test_interpreted_kernel_matches_fp64():
    """The Triton kernel (every image channel in one step where they fit, in steps of a power of
    two where not) under Triton's interpreter, in a new process (``TRITON_INTERPRET`` must be set
    before Triton is imported): ReLU and bias outputs within fp16 rounding of fp64."""
    from fusion_compiler.kernels.space_to_depth import _channels_per_step

    # the programs' rows: 4 output rows of 16 (depth-like), 1 of 128 (the wide image)
    assert _channels_per_step(11, 16, 64) == 16 and _channels_per_step(11, 4, 512) == 8
    for name, errors in run_interpreted(_INTERPRETED, STEM_CASES).items():
        assert len(errors) == 2 and max(errors) < 2e-3, (name, errors)


def test_packed_weight_rows_and_its_description():
    """The kernel's weight: row ``c*16 + tap`` is SpaceToDepth's input channel ``tap*C + c``,
    rows past ``C`` zero; made at every call outside a derivation scope (an in-place update is
    seen), and described as a rearrangement for a CUDA graph's derivation program."""
    from fusion_compiler.kernels.space_to_depth import _pack, packed_weight
    from fusion_compiler.runtime.derive import Expr, evaluate

    weight = torch.randn(8, 16 * 3, 1, 1)
    packed = packed_weight(weight, 3, 4)
    assert packed.shape == (4 * 16, 8) and packed.is_contiguous()
    for c in range(3):
        for tap in range(16):
            assert torch.equal(packed[c * 16 + tap], weight[:, tap * 3 + c, 0, 0])
    assert not packed[3 * 16:].any()
    with torch.no_grad():
        weight.data.mul_(2)
    assert torch.equal(packed_weight(weight, 3, 4)[:16], 2 * packed[:16])
    described = Expr.rearranged(lambda a: _pack(a, c=3, cg=4), Expr.source(0, weight))
    assert torch.equal(evaluate(described, [weight]), packed_weight(weight, 3, 4))