"""The spellings suite: SE-ResNet9-Fixup written the ways people write it
(examples/seresnet9_spellings.py)
compiles to the regions and the kernels between them of the example's spelling, and computes what
each spelling computes. On the CPU the regions run as PyTorch ops; the passes are the ones a CUDA
input gets (``cuda_pipeline``), so what is compared is what a GPU would run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler

from conftest import CUDA_PIPELINE
from fusion_compiler.compiler import CompiledModule
from fusion_compiler.tables import glue_kernels, pytorch_nodes
from examples.seresnet9_fixup import SEFixupBlock, SqueezeExcitation
from examples.seresnet9_spellings import SPELLINGS


def _compiled(name: str):
    model = SPELLINGS[name](base_planes=32)
    compiled = CompiledModule(model, CUDA_PIPELINE, backends=())
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, want = compiled(x), model(x)
    spec = compiled.last
    kernels = ([r.pattern for r in spec.regions], glue_kernels(spec.graph_module),
               [(p["op"], p["reason"]) for p in pytorch_nodes(spec.graph_module)])
    return kernels, out, want


@pytest.mark.parametrize("name", [n for n in SPELLINGS if n != "example"])
def test_a_spelling_gets_the_example_s_regions_and_kernels(name):
    (regions, glue, left), out, want = _compiled(name)
    (best_regions, best_glue, best_left), best_out, _ = _compiled("example")
    assert (regions, glue, left) == (best_regions, best_glue, best_left)
    assert len(regions) == 9 and glue == {"se_scale": 4} and not left  # the example's kernels
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, best_out, rtol=1e-5, atol=1e-5)  # the same network


def test_the_benchmark_and_the_cli_reach_every_spelling():
    from examples.benchmark import MODELS, SPELLINGS as BENCHED
    from fusion_compiler.tools.cli import load_model

    assert sorted(m.removeprefix("spelling-") for m in BENCHED) == sorted(SPELLINGS)
    ref, shape, train = MODELS["spelling-authors"]
    assert shape == (128, 3, 64, 64) and not train
    model = load_model(ref)
    assert sum(p.numel() for p in model.parameters()) == 4_938_256  # the full-size network


# --------------------------------------------------------------------------- one choice at a time

class OneChoiceSE(SqueezeExcitation):
    """The example's SE gate with its squeeze, gate view, multiply and activations replaceable."""

    choices: dict = {}

    def __init__(self, planes: int, reduction: int = 16):
        super().__init__(planes, reduction)
        if "pool" in self.choices:  # a module for the squeeze to call, made for these planes
            self.pool = self.choices["pool"](planes)

    def forward(self, x):
        c = {**EXAMPLE_CHOICES, **self.choices}
        s = c["squeeze"](x, self.pool) if "pool" in c else c["squeeze"](x)
        g = c["sigmoid"](self.fc2(c["se_relu"](self.fc1(s))))
        return c["gate_mul"](x, c["gate_view"](g, x))


class OneChoiceBlock(SEFixupBlock):
    """The example's block with each way of writing an op replaceable (``choices``)."""

    choices: dict = {}

    def __init__(self, inplanes: int, planes: int, stride: int = 1, reduction: int = 16):
        super().__init__(inplanes, planes, stride, reduction)
        self.se = type("SE", (OneChoiceSE,), {"choices": self.choices})(planes, reduction)

    def forward(self, x):
        c = {**EXAMPLE_CHOICES, **self.choices}
        a = c["bias"](x, self.bias1a)
        out = c["relu"](c["bias"](self.conv1(a), self.bias1b))
        out = self.conv2(c["bias"](out, self.bias2a))
        out = c["bias"](c["scale"](out, self.scale), self.bias2b)
        identity = x if self.downsample is None else self.downsample(a)
        return c["relu"](c["residual"](self.se(out), identity))


EXAMPLE_CHOICES = {
    "bias": lambda x, b: x + b, "scale": lambda o, s: o * s, "residual": lambda y, i: y + i,
    "relu": lambda x: F.relu(x, inplace=True), "se_relu": F.relu, "sigmoid": torch.sigmoid,
    "squeeze": lambda x: x.mean((2, 3)), "gate_mul": lambda x, g: x * g,
    "gate_view": lambda g, x: g.view(x.shape[0], x.shape[1], 1, 1)}
"""How the example writes each op that :class:`OneChoiceBlock` can write another way."""


def _iadd(y, i):
    y += i
    return y


ONE_CHOICE = {
    "bias first": {"bias": lambda x, b: b + x},
    "torch.add(bias, x)": {"bias": lambda x, b: torch.add(b, x)},
    "x - (-bias)": {"bias": lambda x, b: x - (-b)},
    "torch.add(x, bias, alpha=1)": {"bias": lambda x, b: torch.add(x, b, alpha=1)},
    "scale first": {"scale": lambda o, s: s * o},
    "identity + out": {"residual": lambda y, i: i + y},
    "out += identity": {"residual": _iadd},
    "y.add(identity, alpha=1)": {"residual": lambda y, i: y.add(i, alpha=1)},
    "torch.sub(y, identity, alpha=-1)": {"residual": lambda y, i: torch.sub(y, i, alpha=-1)},
    "gate first": {"gate_mul": lambda x, g: torch.mul(g, x)},
    "x * gate.expand_as(x)": {"gate_mul": lambda x, g: x * g.expand_as(x)},
    "squeeze sum / (h * w)": {"squeeze": lambda x: x.sum((2, 3)) / (x.shape[2] * x.shape[3])},
    "squeeze sum * (1 / (h * w))": {
        "squeeze": lambda x: x.sum((2, 3)) * (1 / (x.shape[2] * x.shape[3]))},
    "squeeze F.avg_pool2d(x, (h, w))": {
        "squeeze": lambda x: F.avg_pool2d(x, (x.shape[2], x.shape[3])).flatten(1)},
    "squeeze F.avg_pool2d(x, kernel_size=x.shape[2:])": {
        "squeeze": lambda x: F.avg_pool2d(x, kernel_size=x.shape[2:]).view(x.shape[0], -1)},
    "squeeze nn.AvgPool2d((h, w))": {  # base_planes=16, a 64 x 64 image: H = W = 256 // planes
        "pool": lambda planes: torch.nn.AvgPool2d((256 // planes, 256 // planes)),
        "squeeze": lambda x, pool: torch.flatten(pool(x), 1)},
    "squeeze x.flatten(2).mean(-1)": {"squeeze": lambda x: x.flatten(2).mean(-1)},
    "squeeze x.flatten(2).mean(2)": {"squeeze": lambda x: x.flatten(2).mean(2)},
    "squeeze torch.flatten(x, 2).mean(dim=-1)": {
        "squeeze": lambda x: torch.flatten(x, 2).mean(dim=-1)},
    "squeeze x.view(n, c, -1).mean(-1)": {
        "squeeze": lambda x: x.view(x.shape[0], x.shape[1], -1).mean(-1)},
    "squeeze x.reshape(n, c, h * w).mean(2)": {
        "squeeze": lambda x: x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3]).mean(2)},
    "squeeze x.flatten(2).sum(-1) / (h * w)": {
        "squeeze": lambda x: x.flatten(2).sum(-1) / (x.shape[2] * x.shape[3])},
    "relu as x.clamp(min=0)": {"relu": lambda x: x.clamp(min=0)},
    "relu as x.clamp_min(0)": {"relu": lambda x: x.clamp_min(0)},
    "SE relu as torch.clamp(x, 0)": {"se_relu": lambda x: torch.clamp(x, 0)},
    "torch.special.expit": {"sigmoid": torch.special.expit},
    "gate[..., None, None]": {"gate_view": lambda g, x: g[..., None, None]},
}
"""A spelling of the example that differs from it in one choice: name -> the choice."""


def _kernels(model: torch.nn.Module, x: torch.Tensor):
    compiled = CompiledModule(model, CUDA_PIPELINE, backends=())
    with torch.no_grad():
        out, want = compiled(x), model(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    spec = compiled.last
    return ([r.pattern for r in spec.regions], glue_kernels(spec.graph_module),
            [(p["op"], p["reason"]) for p in pytorch_nodes(spec.graph_module)])


@pytest.mark.parametrize("name", ONE_CHOICE)
def test_one_choice_written_another_way_changes_no_region_or_kernel(name):
    from examples.seresnet9_spellings import _spelled

    block = type("Block", (OneChoiceBlock,), {"choices": ONE_CHOICE[name]})
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert _kernels(_spelled(block)(base_planes=16), x) == _kernels(
        _spelled(OneChoiceBlock)(base_planes=16), x)


def test_arithmetic_written_one_way_is_bitwise_the_same_and_inexact_forms_stay():
    from fusion_compiler.capture import capture
    from fusion_compiler.passes.pre_fusion.normalize import normalize
    from fusion_compiler.shapes import propagate_shapes

    class Spelled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Parameter(torch.randn(1, 4, 1, 1))

        def forward(self, x):
            return (self.b + x, 2 * x, x - (-self.b), torch.add(x, self.b, alpha=-1), x / 4,
                    x / 3, torch.add(x, self.b, alpha=2), x * self.b.expand_as(x))

    model, x = Spelled(), torch.randn(2, 4, 3, 3) * 1e3
    gm = capture(model)
    propagate_shapes(gm, [x])
    code = normalize(gm).code
    for written in ("torch.add(x, b)", "torch.mul(x, 2)", "torch.sub(x, b)", "torch.mul(x, 0.25)",
                    "torch.div(x, 3)", "alpha = 2", "torch.mul(x, b)"):
        assert written in code, (written, code)
    assert "neg" not in code and "expand_as" not in code
    with torch.no_grad():
        for got, want in zip(gm(x), model(x), strict=True):
            assert torch.equal(got, want)  # the same bits, not only close


def test_a_clamp_at_zero_is_relu_unless_it_changes_the_dtype():
    """In a graph that is not differentiated (inference); ``min=-0.0`` keeps its clamp (a
    negative input's zero keeps its sign: review finding, session 43)."""
    from fusion_compiler.capture import capture
    from fusion_compiler.passes.pre_fusion.normalize import normalize
    from fusion_compiler.shapes import propagate_shapes

    class Clamps(torch.nn.Module):
        def forward(self, x, i):
            return (x.clamp(min=0), x.clamp_min(0.0), torch.clamp(x, 0, 6), i.clamp(min=0.0),
                    x.clamp(min=-0.0))

    model = Clamps()
    x, i = torch.tensor([-1.0, -0.0, 0.0, 2.0, float("nan")]), torch.tensor([-2, 3])
    gm = capture(model)
    propagate_shapes(gm, [x, i])
    code = normalize(gm, differentiable=False).code
    assert code.count("torch.relu(x)") == 2 and "torch.clamp(x, 0, 6)" in code
    assert "torch.clamp(i, 0.0, None)" in code  # an int tensor clamped to a float: float out
    assert "torch.clamp(x, -0.0, None)" in code
    for got, want in zip(gm(x, i), model(x, i), strict=True):  # float32: the same bits
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int32),
                                                       want.view(torch.int32))


# --------------------------------------------------------------------------- layers that do nothing

def stochastic_depth(input, p, mode, training=True):
    """Stands for ``torchvision.ops.stochastic_depth`` (torchvision is not a dependency): the
    same signature, and the identity where the pass takes it; torchvision wraps it for torch.fx
    as this module does, and the pass knows it by its module and name."""
    if not training or p == 0.0:
        return input
    keep = torch.empty([input.shape[0]] + [1] * (input.dim() - 1)).bernoulli_(1 - p)
    return input * keep / (1 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


class MBConvLike(torch.nn.Module):
    """An EfficientNet-style residual block and head: expand (conv, BN, SiLU), project (conv, BN),
    stochastic depth and the residual add; dropout before the classifier (``layers=False``: the
    same network without the stochastic depth and the dropouts)."""

    def __init__(self, layers: bool = True, p: float = 0.2):
        super().__init__()
        self.expand = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 1, bias=False),
                                          torch.nn.BatchNorm2d(32), torch.nn.SiLU(inplace=True))
        self.project = torch.nn.Sequential(torch.nn.Conv2d(32, 16, 3, padding=1, bias=False),
                                           torch.nn.BatchNorm2d(16))
        self.dropout = torch.nn.Dropout(p, inplace=True) if layers else torch.nn.Identity()
        self.fc = torch.nn.Linear(16, 10)
        self.layers, self.p = layers, p

    def forward(self, x):
        y = self.project(self.expand(x))
        if self.layers:
            y = stochastic_depth(y, self.p, "row", self.training)
            y = F.dropout2d(y, 0.1, self.training)
        pooled = (y + x).mean((2, 3))
        return self.fc(self.dropout(pooled))


def test_layers_that_return_their_input_in_eval_mode_leave_no_op():
    torch.manual_seed(0)
    written, plain = MBConvLike().eval(), MBConvLike(layers=False).eval()
    plain.load_state_dict(written.state_dict())
    x = torch.randn(2, 16, 8, 8)
    regions, glue, left = _kernels(written, x)
    assert (regions, glue, left) == _kernels(plain, x)
    assert "conv3x3 > mul > add > add" in regions  # the residual add joined the region
    with torch.no_grad():
        assert torch.equal(CompiledModule(written, CUDA_PIPELINE, backends=())(x), plain(x))


def test_dropout_and_stochastic_depth_stay_where_they_draw_random_numbers():
    from fusion_compiler.capture import capture
    from fusion_compiler.passes.pre_fusion.identities import drop_identities

    model = MBConvLike().train()
    assert drop_identities(capture(model)) == []
    model.p = 0.0  # torchvision's stochastic depth returns its input at p = 0 in training too
    assert drop_identities(capture(model)) == ["stochastic_depth"]
    model.eval()
    assert sorted(drop_identities(capture(model))) == ["dropout", "dropout2d", "stochastic_depth"]
    model.dropout.train()  # a module's own mode counts
    assert sorted(drop_identities(capture(model))) == ["dropout2d", "stochastic_depth"]


def test_an_in_place_add_to_stochastic_depth_s_result_writes_its_input():
    """In eval mode stochastic depth returns its input itself, so ``r += x`` writes ``y`` too,
    as eager does (review finding, session 43: the compiled ``y`` kept its old value)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            r = stochastic_depth(y, 0.2, "row", self.training)
            r += x
            return r, y

    model, x = M().eval(), torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        want = model(x)
        for run in (fusion_compiler.compile(model), CompiledModule(model, CUDA_PIPELINE,
                                                                   backends=())):
            for g, w in zip(run(x), want, strict=True):
                torch.testing.assert_close(g, w)


def test_torchvision_s_stochastic_depth_is_the_one_the_pass_takes():
    ops = pytest.importorskip("torchvision.ops")

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.drop = ops.StochasticDepth(0.2, "row")

        def forward(self, x):
            return self.drop(self.conv(x)) + x

    regions, glue, left = _kernels(Residual().eval(), torch.randn(2, 8, 8, 8))
    assert regions == ["conv3x3 > add > add"] and not left


def _normalized(model: torch.nn.Module, x: torch.Tensor):
    from fusion_compiler.capture import capture
    from fusion_compiler.passes.pre_fusion.normalize import normalize
    from fusion_compiler.shapes import propagate_shapes

    gm = capture(model)
    propagate_shapes(gm, [x])
    return normalize(gm)


def test_only_an_avg_pool_over_the_whole_image_becomes_the_spatial_mean():
    class Pools(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = torch.nn.AvgPool2d((6, 5))

        def forward(self, x):
            whole = (self.pool(x), F.avg_pool2d(x, (6, 5)),
                     F.avg_pool2d(x, kernel_size=x.shape[2:], stride=(6, 5)))
            return whole, (
                F.avg_pool2d(x, (3, 5)),  # a smaller window
                F.avg_pool2d(x, (4, 3), stride=2),  # strided
                F.avg_pool2d(x, (6, 5), stride=1),  # one window, but another stride: as written
                F.avg_pool2d(x, (6, 5), padding=1),  # padded: one window, other values
                F.avg_pool2d(x, (4, 4), ceil_mode=True),
                F.avg_pool2d(x, (6, 5), ceil_mode=True),  # one window: left as written too
                F.avg_pool2d(x, (6, 5), divisor_override=7),
                F.avg_pool2d(x[0], (6, 5)))  # 3-d

    model, x = Pools(), torch.randn(2, 4, 6, 5)
    gm = _normalized(model, x)
    assert gm.code.count("torch.sum(x, [2, 3], keepdim = True)") == 3, gm.code
    assert gm.code.count("avg_pool2d(") == 8, gm.code
    with torch.no_grad():
        (whole, others), (want_whole, want_others) = gm(x), model(x)
    torch.testing.assert_close(whole, want_whole)  # rounding: the pool sums in its own order
    for got, want in zip(others, want_others, strict=True):
        assert torch.equal(got, want)


def test_a_clamp_at_zero_keeps_its_gradient_in_training():
    """``clamp(x, min=0)`` passes the gradient where ``x == 0``, ReLU does not: in training the
    clamp stays (review finding, session 43: the rewrite zeroed those gradients)."""
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 3, 3, padding=1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = model

        def forward(self, x):
            return self.conv(torch.clamp(x, min=0))

    net = Net()
    x = torch.randn(2, 3, 6, 6)
    x[:, :, :3] = 0
    grads = []
    for run in (net, fusion_compiler.compile(net), CompiledModule(net, CUDA_PIPELINE,
                                                                   backends=())):
        xi = x.clone().requires_grad_()
        run(xi).square().sum().backward()
        grads.append(xi.grad)
    assert grads[0][:, :, :3].abs().sum() > 0
    for got in grads[1:]:
        torch.testing.assert_close(got, grads[0])


def test_two_broadcasts_of_one_op_are_not_both_dropped():
    """``p.expand(shape) * q.expand(shape)`` where neither ``p`` nor ``q`` alone covers the
    shape: one expand stays (review finding, session 43: both went, the value shrank)."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(1, 1, 4, 4))
            self.chan = torch.nn.Parameter(torch.randn(1, 3, 1, 1))
            self.conv = torch.nn.Conv2d(3, 3, 1)

        def forward(self, x):
            n, c, h, w = x.shape
            e = self.pos.expand(n, c, h, w) * self.chan.expand(n, c, h, w)
            t = self.chan.expand_as(x) / torch.broadcast_to(self.pos, x.shape)
            return self.conv(x) + e, e.sum(), t

    model, x = M().eval(), torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        want = model(x)
        for run in (fusion_compiler.compile(model), CompiledModule(model, CUDA_PIPELINE,
                                                                   backends=())):
            got = run(x)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w)


def test_an_fp16_spatial_mean_of_large_values_does_not_overflow():
    """The canonical mean of a half-precision image sums into fp32 and casts after the scale,
    as eager's mean does (before: a sum past 65504 was inf; review finding, session 43)."""
    class M(torch.nn.Module):
        def forward(self, x):
            return F.avg_pool2d(x, 8), x.flatten(2).mean(-1), x.mean((2, 3))

    x = torch.full((1, 2, 8, 8), 2000.0, dtype=torch.float16)
    with torch.no_grad():
        got, want = fusion_compiler.compile(M())(x), M()(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_global_pool_before_a_1x1_convolution_is_a_mean_then_the_convolution():
    """A classifier head written as ``AvgPool2d(H)`` + 1x1 convolution: the pool is the spatial
    mean (as ``adaptive_avg_pool2d(x, 1)`` is), so ``avgpool_conv`` no longer makes the two one
    H x W convolution; the mean and the small convolution compute eager's values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AvgPool2d(7), torch.nn.Conv2d(16, 10, 1)).eval()
    x = torch.randn(2, 8, 7, 7)
    compiled = CompiledModule(model, CUDA_PIPELINE, backends=())
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert [r.pattern for r in compiled.last.regions] == ["conv3x3 > add > relu"]
    assert "torch.sum(" in compiled.last.graph_module.code
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_only_a_mean_over_h_and_w_flattened_becomes_the_spatial_mean():
    class Means(torch.nn.Module):
        def forward(self, x):
            n, c, h, w = x.shape
            return (x.flatten(2).mean(-1), x.flatten(2, 3).sum(dim=[2]),
                    x.view(n, c, -1).mean(-1, keepdim=True)), (
                x.flatten(1).mean(-1), x.flatten(2).mean(1), x.view(n, c * h, w).mean(-1),
                x.flatten(0, 1).mean(-1), x.flatten(2).mean(-1, dtype=torch.float64))

    model, x = Means(), torch.randn(2, 4, 6, 5)
    gm = _normalized(model, x)
    assert gm.code.count("torch.sum(x, [2, 3], keepdim = True)") == 3, gm.code
    assert gm.code.count(".mean(") == 5, gm.code
    with torch.no_grad():
        (spatial, others), (want_spatial, want_others) = gm(x), model(x)
    for got, want in zip(spatial, want_spatial, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)  # a multiply by 1/30 for the division by 30
    for got, want in zip(others, want_others, strict=True):
        assert torch.equal(got, want)
