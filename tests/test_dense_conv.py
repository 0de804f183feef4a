"""Convolutions of small images as one dense GEMM (the ``dense`` backend) on the CPU: the dense
weight against ``conv2d`` in fp64, the folding of the epilogue, which regions the backend takes,
a compile whose small-image regions run the kernel (its torch ops, with the backend's CUDA check
lifted) against fp64, and the cached choice among backends. tests/test_gpu_dense_conv.py runs
it on a GPU against cuDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.seresnet9_fixup import randomized_se_resnet9_fixup
from fusion_compiler import lowering
from fusion_compiler.backends.base import Lowered
from fusion_compiler.backends.dense import DenseConvBackend
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.ir.errors import UnsupportedError
from fusion_compiler.kernels.conv import ConvProgram
from fusion_compiler.kernels.dense_conv import dense_program, dense_weight, fold_affine
from fusion_compiler.runtime.plan_cache import PlanCache
from conftest import CUDA_PIPELINE, rel_err, specialize

ADD, SUB, MUL, DIV, RELU = 1, 2, 3, 4, 5


@pytest.mark.parametrize("h, w, r, stride, padding, dilation", [
    (2, 2, 3, 1, 1, 1),  # SE-ResNet9's layer3 at 64x64 inputs
    (4, 4, 3, 2, 1, 1),
    (3, 3, 5, 1, 2, 1),
    (2, 3, 3, 1, 2, 2),
    (1, 1, 3, 1, 1, 1),
])
def test_dense_weight_is_the_convolution(h, w, r, stride, padding, dilation):
    torch.manual_seed(0)
    x = torch.randn(3, 5, h, w, dtype=torch.float64)
    weight = torch.randn(7, 5, r, r, dtype=torch.float64)
    pair = lambda v: (v, v)  # noqa: E731
    program = ConvProgram(0, 1, pair(stride), pair(padding), pair(dilation), (), (), (), (0,))
    dense = dense_weight(weight, (h, w), program).double()
    want = F.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)
    ho, wo = want.shape[2:]
    got = (x.permute(0, 2, 3, 1).reshape(3, -1) @ dense).view(3, ho, wo, 7).permute(0, 3, 1, 2)
    assert dense.shape == (h * w * 5, ho * wo * 7)
    assert rel_err(got, want) < 1e-6  # the weight went through fp32 once


def test_fold_affine_applies_the_ops_in_turn():
    torch.manual_seed(0)
    v = torch.randn(6, dtype=torch.float64)
    a, b, c, d = torch.rand(1) + 0.5, torch.randn(6), torch.rand(1) + 0.5, torch.randn(6)
    scale, shift = fold_affine((MUL, ADD, RELU, DIV, SUB), [a, b, c, d], 6)
    want = ((v * a + b) / c) - d  # the ReLU code is skipped: the kernel applies it last
    assert torch.allclose(v * scale.double() + shift.double(), want.double(), atol=1e-6)


class _Block(nn.Module):
    """A 3x3 convolution of a 2x2 image with an epilogue: per-channel scale, a Fixup scalar, a
    ReLU folded; then a residual add and SiLU left as torch ops, a second output among them."""

    def __init__(self, tail: bool):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding=1, bias=False)
        self.scale = nn.Parameter(torch.rand(1, 32, 1, 1) + 0.5)
        self.bias = nn.Parameter(torch.randn(1))
        self.tail = tail

    def forward(self, x):
        y = torch.relu(self.conv(x) * self.scale + self.bias)
        if not self.tail:
            return y
        z = y + x
        return F.silu(z), z


def _compiled(model, x, monkeypatch, **options):
    monkeypatch.setattr(DenseConvBackend, "devices", ("cuda", "cpu"))
    compiled = CompiledModule(model, options=CUDA_PIPELINE, **options)
    with torch.no_grad():
        return compiled, compiled(x)


@pytest.mark.parametrize("tail", [False, True])
def test_small_image_regions_run_the_dense_gemm(tail, monkeypatch):
    torch.manual_seed(0)
    model = _Block(tail).to(torch.bfloat16).eval()
    x = torch.randn(4, 32, 2, 2, dtype=torch.bfloat16)
    compiled, got = _compiled(model, x, monkeypatch)
    region = compiled.last.regions[0]
    assert region.backend == "dense" and "dense GEMM [128 x 128]" in region.plan, \
        compiled.report()
    assert ("2 epilogue ops as PyTorch ops" in region.plan) == tail
    with torch.no_grad():
        want = model.double()(x.double())
    got, want = (got, want) if tail else ((got,), (want,))
    for g, e in zip(got, want):
        assert g.dtype == torch.bfloat16 and rel_err(g.double(), e) < 1e-2


def test_se_resnet9_layer3_region_takes_the_dense_gemm(monkeypatch):
    """Of SE-ResNet9's regions at 64x64 inputs only layer3's second convolution (3x3 of a 2x2
    image) is small; its outputs through the dense GEMM as eager's."""
    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup().to(torch.bfloat16).eval()
    x = torch.randn(2, 3, 64, 64, dtype=torch.bfloat16)
    compiled, got = _compiled(model, x, monkeypatch)
    dense = [r for r in compiled.last.regions if r.backend == "dense"]
    assert [r.pattern for r in dense] == ["conv3x3 > mul > add"], compiled.report()
    with torch.no_grad():
        want = model.double()(x.double())
    assert rel_err(got.double(), want) < 2e-2


def test_off_with_the_option_and_without_cuda(monkeypatch):
    model = _Block(False).to(torch.bfloat16).eval()
    x = torch.randn(4, 32, 2, 2, dtype=torch.bfloat16)
    compiled, _ = _compiled(model, x, monkeypatch, backends=("triton_stem", "cudnn"))
    assert compiled.last.regions[0].backend == "reference"
    monkeypatch.setattr(DenseConvBackend, "devices", ("cuda",))
    compiled = CompiledModule(model, options=CUDA_PIPELINE)
    with torch.no_grad():
        compiled(x)
    assert compiled.last.regions[0].backend == "reference"


class _ConvValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)

    def forward(self, x):
        y = self.conv(x)
        return y, y * 2.0


@pytest.mark.parametrize("model, x, why", [
    (nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)), torch.randn(1, 16, 4, 4), "more pixels"),
    (_ConvValue(), torch.randn(1, 16, 2, 2), "inside the epilogue folded"),
])
def test_regions_the_dense_gemm_does_not_take(model, x, why):
    spec = specialize(model.to(torch.bfloat16).eval(), x.to(torch.bfloat16))
    program = dense_program(spec.regions[0], torch.device("cpu"))
    assert isinstance(program, str) and why in program


def test_training_regions_are_declined():
    spec = specialize(_Block(False).to(torch.bfloat16).eval(), torch.randn(1, 32, 2, 2,
                                                                            dtype=torch.bfloat16))
    with pytest.raises(UnsupportedError, match="inference only"):
        DenseConvBackend().lower(spec.regions[0], training=True)


@pytest.fixture
def timings(monkeypatch) -> list:
    """Lowering's timing faked as on a GPU (cuDNN 0.02 ms, the other 0.01); one entry appended
    to the returned list per timing."""
    timed = []
    monkeypatch.setattr(lowering, "node_device", lambda node: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(lowering, "paired_time_ms", lambda runs: timed.append(1) or [0.02, 0.01])
    monkeypatch.setattr(lowering, "sample_inputs", lambda region: [])
    return timed


def test_the_choice_among_backends_is_timed_once(tmp_path, timings):
    """The first compile times the candidates and stores the winner; a later one (another
    PlanCache on the same directory: another process) takes it untimed."""
    spec = specialize(_Block(False).to(torch.bfloat16).eval(), torch.randn(1, 32, 2, 2,
                                                                            dtype=torch.bfloat16))
    region = spec.regions[0]
    timed = timings
    lowered = {"cudnn": Lowered(print), "dense": Lowered(print)}
    first = lowering._fastest(region, lowered, PlanCache(tmp_path))
    again = lowering._fastest(region, lowered, PlanCache(tmp_path))
    assert first == again == ("dense", {"cudnn": 0.02, "dense": 0.01}) and timed == [1]
    other = lowering._fastest(region, {"cudnn": Lowered(print), "triton_conv": Lowered(print)},
                              PlanCache(tmp_path))  # other candidates: timed again
    assert other[0] == "triton_conv" and timed == [1, 1]


def test_a_choice_is_followed_at_a_batch_size_within_a_factor_of_2(tmp_path, timings):
    timed = timings
    lowered = {"cudnn": Lowered(print), "dense": Lowered(print)}
    model = _Block(False).to(torch.bfloat16).eval()
    regions = {n: specialize(model, torch.randn(n, 32, 2, 2, dtype=torch.bfloat16)).regions[0]
               for n in (4, 8, 9)}
    assert lowering._fastest(regions[4], lowered, PlanCache(tmp_path))[0] == "dense"
    assert lowering._fastest(regions[8], lowered, PlanCache(tmp_path)) == ("dense", {})
    assert timed == [1]
    lowering._fastest(regions[9], lowered, PlanCache(tmp_path))  # 9 > 2 * 4: timed
    assert timed == [1, 1]


def test_a_value_made_from_a_view_made_afresh_at_every_call_is_reused_within_an_epoch():
    """A graph reshapes a conv bias to ``[1, K, 1, 1]`` at every call: within one derivation
    epoch (one capture) the value made from it is made once; another view of the base, or a new
    epoch, makes it again; outside an epoch it is made at every call."""
    from fusion_compiler.runtime.weight_cache import WeightCache, derivation_epoch

    made = []
    cache = WeightCache(lambda w, b: made.append(1) or (w * 2, b + 1))
    weight, bias = torch.randn(4, 4), torch.randn(4)
    with derivation_epoch():
        for _ in range(3):
            cache(weight, bias.view(1, 4, 1, 1))
        assert made == [1]
        cache(weight, bias.view(4, 1, 1, 1))  # another view of the same base: made again
        assert made == [1, 1]
    cache(weight, bias.view(1, 4, 1, 1)), cache(weight, bias.view(1, 4, 1, 1))
    assert made == [1, 1, 1, 1]


def test_the_dense_weight_follows_every_update_of_the_weight_and_the_folded_bias(monkeypatch):
    """A 3x3 convolution with a bias on 2x2 images runs the dense GEMM; outside a CUDA graph
    its dense weight and bias vector are made at each call, so in-place updates, ``.data``
    writes and a reassigned parameter are all seen. The description of the dense weight that a
    CUDA graph's derivation program uses computes the same values."""
    from fusion_compiler.runtime.derive import Expr, evaluate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()).to(torch.bfloat16).eval()
    x = torch.randn(4, 16, 2, 2, dtype=torch.bfloat16)
    compiled, _ = _compiled(model, x, monkeypatch)
    assert compiled.last.regions[0].backend == "dense"
    updates = [lambda: model[0].bias.add_(0.5), lambda: model[0].weight.data.mul_(-2.0),
               lambda: setattr(model[0], "bias", nn.Parameter(torch.randn(16).bfloat16()))]
    for update in updates:
        with torch.no_grad():
            update()
            got = compiled(x)
            want = model.double()(x.double())
            model.to(torch.bfloat16)
        assert rel_err(got.double(), want) < 1e-2
    kernel = compiled.last.regions[0].kernel.__self__
    weight, bias = model[0].weight, model[0].bias.view(1, 16, 1, 1)
    dense, shift = kernel._prepare(weight, bias)
    exprs = kernel._describe(Expr.source(0, weight), Expr.source(1, bias))
    assert torch.equal(evaluate(exprs[0], [weight, bias]).bfloat16(), dense)
    assert torch.equal(evaluate(exprs[1], [weight, bias]).bfloat16(), shift)


@pytest.mark.parametrize("image, taps, small", [
    ((2, 2), (3, 3), True), ((3, 3), (3, 3), True), ((4, 4), (3, 3), False),
    ((1, 1), (1, 1), False),  # a GEMM already: left to cuDNN (SE layers of 1x1 images)
    ((1, 1), (3, 3), True)])
def test_small_images(image, taps, small):
    from types import SimpleNamespace

    from fusion_compiler.kernels.dense_conv import small_image

    value = lambda *shape: SimpleNamespace(meta={"val": torch.empty(shape)})  # noqa: E731
    region = SimpleNamespace(conv=SimpleNamespace(args=(value(4, 16, *image),
                                                        value(8, 16, *taps))))
    assert small_image(region) == small


def test_a_fallback_reports_the_general_backends_reason(monkeypatch):
    """In training the dense backend declines every region ("inference only"); where the
    backend after it declines too, the region's reason is that backend's, not the dense one's."""
    from fusion_compiler.backends.base import Backend, Support
    from fusion_compiler.backends.reference import ReferenceBackend

    class Declines(Backend):
        name = "cudnn"

        def supports(self, region):
            return Support(True)

        def lower(self, region, training=False, backward=None):
            raise UnsupportedError("PyTorch's ops were faster", region.region_id)

    spec = specialize(_Block(False).to(torch.bfloat16).eval(), torch.randn(1, 32, 2, 2,
                                                                            dtype=torch.bfloat16))
    choice = lowering._choose(spec.regions[0], [DenseConvBackend(), Declines()], "",
                              ReferenceBackend(), True, None, PlanCache(None))
    assert choice.backend.name == "reference" and choice.reason == "PyTorch's ops were faster"


def test_plan_work_says_tune_until_the_choice_is_stored(tmp_path, timings, monkeypatch):
    """A region two backends take needs a timing (``"tune"``) until its choice is stored."""
    from types import SimpleNamespace

    from fusion_compiler.config import CompileOptions

    spec = specialize(_Block(False).to(torch.bfloat16).eval(), torch.randn(1, 32, 2, 2,
                                                                            dtype=torch.bfloat16))
    region = spec.regions[0]
    backends = [SimpleNamespace(name="cudnn"), SimpleNamespace(name="dense")]
    monkeypatch.setattr(lowering, "_asked_in", lambda gm, options: ({}, {region: backends}))
    options = CompileOptions(cache_dir=tmp_path)
    assert lowering.plan_work(spec.graph_module, options) == "tune"
    lowering._fastest(region, {"cudnn": Lowered(print), "dense": Lowered(print)},
                      PlanCache(tmp_path))
    assert lowering.plan_work(spec.graph_module, options) == "" and timings == [1]
