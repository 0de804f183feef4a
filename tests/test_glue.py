"""The glue rewrites for Inductor (``passes/glue/``) and the squeeze-and-excitation rewrites into
this package's kernels (``passes/post_lowering/se_gate.py``), on the CPU."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fusion_compiler.kernels.se_gate import se_gate, se_scale
from fusion_compiler.passes.glue import MAX_WEIGHT, inductor_work, small_linears_as_reductions
from fusion_compiler.passes.post_lowering.se_gate import se_gates, se_scales


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


def _private_graph(model, *x):
    """The copy of ``compile(model)``'s graph that the glue rewrites get (normalized ops, regions
    opaque), and the compiled module's output on ``x``."""
    import fusion_compiler as fc
    from fusion_compiler.ir.region import Region
    from fusion_compiler.runtime.tiered import isolated_copy

    compiled = fc.compile(model, cache_dir=False, glue_backend=None)
    with torch.inference_mode():
        want = compiled(*x)
    return isolated_copy(compiled.last.graph_module, opaque=lambda m: isinstance(m, Region)), want


def test_se_gates_replace_the_reference_networks_four_gates_with_the_same_result():
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup

    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    gm, want = _private_graph(randomize_(se_resnet9_fixup(3)).eval(), x)
    assert se_gates(gm) == 4
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(se_gate) == 4
    assert torch.sigmoid not in ops and torch.relu in ops  # the blocks' own ReLUs stay
    assert not [n for n in gm.graph.nodes if n.op == "call_module"
                and isinstance(gm.get_submodule(n.target), nn.Linear)]
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), want, rtol=1e-4, atol=1e-5)


def test_se_gates_match_the_eager_gate_and_leave_other_activations_alone():
    torch.manual_seed(0)
    x = torch.randn(3, 32, 6, 5) + 0.25
    gm, want = _private_graph(_SE(c=32, r=4).eval(), x)
    assert se_gates(gm) == 1
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-6)

    class TanhGate(_SE):
        def forward(self, x):
            g = torch.sigmoid(self.fc2(torch.tanh(self.fc1(x.mean((2, 3))))))
            return x * g[:, :, None, None]

    gm, _ = _private_graph(TanhGate(c=32, r=4).eval(), x)
    assert se_gates(gm) == 0


def test_se_gates_of_1x1_convolutions_with_silu_as_torchvision_writes_them():
    """An SE block written as torchvision's ``SqueezeExcitation`` is (EfficientNet: SiLU; RegNet:
    ReLU) inside a conv block: the fuse pass leaves the SE convolutions to the glue, and the gate
    becomes the op."""
    class SqueezeExcitation(nn.Module):
        def __init__(self, channels, squeezed, activation):
            super().__init__()
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)
            self.activation, self.scale_activation = activation(), nn.Sigmoid()

        def forward(self, x):
            scale = self.fc2(self.activation(self.fc1(self.avgpool(x))))
            return x * self.scale_activation(scale)

    class Block(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.conv = nn.Conv2d(16, 48, 3, padding=1)
            self.se = SqueezeExcitation(48, 12, activation=act)

        def forward(self, x):
            return torch.relu(self.se(self.conv(x)))

    from fusion_compiler.passes.post_lowering import se_gate as glue

    torch.manual_seed(0)
    x = torch.randn(2, 16, 7, 7)
    for act, fused_squeeze in ((nn.SiLU, glue.FUSED_SQUEEZE), (nn.ReLU, 48 * 7 * 7 - 1)):
        gm, want = _private_graph(Block(act).eval(), x)
        with pytest.MonkeyPatch.context() as patch:  # a smaller limit: the pooled mean goes in
            patch.setattr(glue, "FUSED_SQUEEZE", fused_squeeze)
            assert se_gates(gm) == 1
        assert not [n for n in gm.graph.nodes if n.target is torch.conv2d]
        gate = next(n for n in gm.graph.nodes if n.target is se_gate)
        pooled = gate.args[0].meta["val"].shape[2:] == (1, 1)
        assert pooled == (fused_squeeze < 48 * 7 * 7), act
        with torch.inference_mode():
            torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-5)


def test_se_gates_take_mobilenet_v3s_hard_sigmoid_gate_and_its_tail():
    """torchvision's MobileNetV3 writes its SE block as ``SqueezeExcitation(scale_activation=
    nn.Hardsigmoid)``: ReLU between 1x1 convolutions, the hard sigmoid as the gate. The gate
    becomes one ``se_gate(..., "relu", "hardsigmoid")`` and the multiply with the residual add
    after it one ``se_scale``, with the module's result."""
    class SqueezeExcitation(nn.Module):
        def __init__(self, channels, squeezed):
            super().__init__()
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc1, self.fc2 = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)
            self.activation, self.scale_activation = nn.ReLU(), nn.Hardsigmoid()

        def forward(self, x):
            return x * self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(24, 24, 3, padding=1)
            self.se = SqueezeExcitation(24, 8)

        def forward(self, x):
            return self.se(self.conv(x)) + x

    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 24, 7, 7)
    with torch.no_grad():  # gates in the linear part of the hard sigmoid and beyond it
        model.se.fc2.bias.copy_(torch.linspace(-4, 4, 24))
    gm, want = _private_graph(model, x)
    assert se_gates(gm) == 1 and se_scales(gm) == 1
    (scale,) = [n for n in gm.graph.nodes if n.target is se_scale]
    assert scale.args[5:] == ("relu", scale.args[6], False, None, "hardsigmoid")
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), want, rtol=1e-5, atol=1e-5)


def test_se_blocks_under_autocast_take_the_fp32_weights_as_they_are():
    """Under ``torch.autocast`` the SE layers' fp32 weights meet activations in the autocast
    dtype (autocast casts them when the layer runs): the gates still become the package's kernel,
    which reads every weight into fp32, and the result is eager autocast's to its rounding."""
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.compiler import CompiledModule

    from conftest import CUDA_PIPELINE

    torch.manual_seed(0)
    model, x = randomize_(se_resnet9_fixup(3)).eval(), torch.randn(2, 3, 64, 64)
    compiled = CompiledModule(model, CUDA_PIPELINE, cache_dir=False, glue_backend=None)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got, eager = compiled(x), model(x)
    graph = compiled.last.graph_module.graph
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert ops.count(se_scale) == 4
    assert got.dtype == eager.dtype == torch.float32  # the Fixup biases promote, as in eager
    (last,) = graph.find_nodes(op="output")[0].all_input_nodes  # the cast up is the kernel's
    assert last.target is se_scale and last.args[-1] is torch.float32
    with torch.no_grad():
        reference = model(x)
    scale = reference.abs().max()
    assert (got - reference).abs().max() / scale <= 2 * (eager - reference).abs().max() / scale


def test_under_autocast_the_glue_casts_only_the_image_and_the_output():
    """The autocast pass casts no value that is already in the autocast dtype: the channel
    views (``narrow``) of horizontally fused convolutions are followed, so SE-ResNet9's lowered
    graph casts only the fp32 image, for the stem (before, each view fed its convolution through
    a cast, glue that Inductor was then chosen for); the output's cast back to eager's fp32 is
    the last ``se_scale`` kernel's (it writes fp32). The image's cast, after the SpaceToDepth's
    copying reshape, is left to Inductor, and where Triton runs the stem region takes it along
    (tests/test_space_to_depth.py), leaving Inductor nothing."""
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.compiler import CompiledModule

    from conftest import CUDA_PIPELINE

    model, x = randomize_(se_resnet9_fixup(3)).eval(), torch.randn(2, 3, 64, 64)
    compiled = CompiledModule(model, CUDA_PIPELINE, cache_dir=False, glue_backend=None)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        spec = compiled.specialize(x)
    graph = spec.graph_module.graph
    casts = [n for n in graph.nodes if n.op == "call_method" and n.target == "to"]
    assert [(n.args[0].op, n.args[1]) for n in casts] == [("call_function", torch.bfloat16)]
    assert casts[0].args[0].meta["val"].dtype == torch.float32  # the SpaceToDepth of the image
    assert any(n.target is torch.narrow for n in graph.nodes)  # horizontal fusion's views
    assert inductor_work(spec.graph_module) == [casts[0]]


def test_the_se_gate_op_is_the_formula_in_fp32_and_traceable():
    torch.manual_seed(0)
    x = torch.randn(4, 24, 5, 7).contiguous(memory_format=torch.channels_last)
    w1, b1, w2, b2 = torch.randn(6, 24), torch.randn(6), torch.randn(24, 6), torch.randn(24)
    h = torch.relu(x.double().mean((2, 3)) @ w1.double().T + b1.double())
    want = torch.sigmoid(h @ w2.double().T + b2.double())
    torch.testing.assert_close(se_gate(x, w1, b1, w2, b2).double(), want, rtol=1e-5, atol=1e-6)
    h = torch.nn.functional.silu(x.double().mean((2, 3)) @ w1.double().T + b1.double())
    torch.testing.assert_close(se_gate(x, w1, b1, w2, b2, "silu").double(),
                               torch.sigmoid(h @ w2.double().T + b2.double()), rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.fusion_compiler.se_gate.default, (x, w1, None, w2, b2, "silu"))
    with pytest.raises(ValueError, match="act must be"):
        se_gate(x, w1, b1, w2, b2, "gelu")
    z = torch.relu(x.double().mean((2, 3)) @ w1.double().T + b1.double()) @ w2.double().T
    torch.testing.assert_close(se_gate(x, w1, b1, w2, None, "relu", "hardsigmoid").double(),
                               torch.clamp(z + 3, 0, 6) / 6, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.fusion_compiler.se_gate.default,
                          (x, w1, b1, w2, None, "relu", "hardsigmoid"))
    with pytest.raises(ValueError, match="gate must be 'sigmoid' or 'hardsigmoid'"):
        se_gate(x, w1, b1, w2, b2, "relu", "tanh")



def _se_scale_want(x, w1, b1, w2, b2, residual=None, relu=False, bias=None):
    h = torch.relu(x.double().mean((2, 3)) @ w1.double().T + b1.double())
    y = x.double() * torch.sigmoid(h @ w2.double().T + b2.double())[:, :, None, None]
    if residual is not None:
        y = y + residual.double()
    if relu:
        y = torch.relu(y)
    return y if bias is None else y + bias.double()


def test_the_se_scale_op_is_the_block_tail_in_fp32_laid_out_as_its_input():
    torch.manual_seed(0)
    x = torch.randn(4, 24, 5, 7).contiguous(memory_format=torch.channels_last)
    w1, b1, w2, b2 = torch.randn(6, 24), torch.randn(6), torch.randn(24, 6), torch.randn(24)
    residual, bias = torch.randn(4, 24, 5, 7), torch.randn(1)  # the residual NCHW
    got = se_scale(x, w1, b1, w2, b2, "relu", residual, True, bias)
    assert got.shape == x.shape and got.stride() == x.stride() and got.dtype == x.dtype
    want = _se_scale_want(x, w1, b1, w2, b2, residual, True, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(se_scale(x.contiguous(), w1, b1, w2, b2).double(),
                               _se_scale_want(x, w1, b1, w2, b2), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.fusion_compiler.se_scale.default,
                          (x, w1, b1, w2, None, "silu", residual, False, bias))
    hard = se_scale(x, w1, b1, w2, b2, "relu", residual, True, None, "hardsigmoid")
    z = torch.relu(x.double().mean((2, 3)) @ w1.double().T + b1.double()) @ w2.double().T
    g = torch.clamp(z + b2.double() + 3, 0, 6) / 6
    torch.testing.assert_close(hard.double(), torch.relu(x.double() * g[:, :, None, None]
                                                         + residual.double()),
                               rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.fusion_compiler.se_scale.default,
                          (x, w1, b1, w2, b2, "relu", None, False, None, "hardsigmoid"))
    with pytest.raises(ValueError, match="residual of shape"):
        se_scale(x, w1, b1, w2, b2, "relu", residual[:, :, :4])
    with pytest.raises(ValueError, match="one element"):
        se_scale(x, w1, b1, w2, b2, "relu", None, False, torch.randn(2))


def test_traced_graphs_call_the_se_ops():
    """Graphs call :func:`se_gate` and :func:`se_scale`, plain functions; a trace (AOTAutograd's,
    under fake tensors) records their ``torch.library`` ops instead of the kernels' bodies."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(2, 8, 3, 3)
    w1, w2 = torch.randn(2, 8), torch.randn(8, 2)

    def f(x, w1, w2):
        return se_scale(x, w1, None, w2, None, "relu", x, True, None) + se_gate(
            x, w1, None, w2, None)[:, :, None, None]

    traced = make_fx(f, tracing_mode="fake")(x, w1, w2)
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert {torch.ops.fusion_compiler.se_scale.default,
            torch.ops.fusion_compiler.se_gate.default} <= targets


def test_se_scales_fold_the_reference_networks_block_tails_into_the_gates():
    """SE-ResNet9: each of the four gates is applied in its own kernel; in the block without a
    downsample convolution the residual add, the ReLU and the next block's scalar bias come
    along (the downsample blocks' regions take the scaled value as their epilogue operand)."""
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup

    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    gm, want = _private_graph(randomize_(se_resnet9_fixup(3)).eval(), x)
    assert se_gates(gm) == 4 and se_scales(gm) == 4
    scales = [n for n in gm.graph.nodes if n.target is se_scale]
    assert [(n.args[6] is not None, n.args[7], n.args[8] is not None) for n in scales] == [
        (True, True, True), (False, False, False), (False, False, False), (False, False, False)]
    assert not [n for n in gm.graph.nodes if n.target in (se_gate, torch.mul, torch.sigmoid)]
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), want, rtol=1e-4, atol=1e-5)


def test_se_scales_stop_where_a_step_has_another_user():
    class Tail(_SE):
        def forward(self, x, r):
            y = x * torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3))))))[:, :, None,
                                                                                      None]
            z = torch.relu(y + r)
            return z, y  # y is read twice: the add and the ReLU stay graph ops

    torch.manual_seed(0)
    x, r = torch.randn(3, 32, 4, 4), torch.randn(3, 32, 4, 4)
    gm, want = _private_graph(Tail(c=32, r=4).eval(), x, r)
    assert se_gates(gm) == 1 and se_scales(gm) == 1
    scale = next(n for n in gm.graph.nodes if n.target is se_scale)
    assert scale.args[6:] == (None, False, None)
    with torch.inference_mode():
        for got, expected in zip(gm(x, r), want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_inductor_work_is_none_when_the_glue_is_this_packages_kernels():
    """The CUDA pipeline's graph of SE-ResNet9 (as ``fusion-compiler dump`` compiles it) leaves
    Inductor nothing to compile: regions, the SE kernels and views; the BPS encoder's head (a
    linear layer, layer norm, ReLU) is Inductor's."""
    from examples.seresnet9_fixup import bps_visual_encoder, randomize_, se_resnet9_fixup
    from fusion_compiler.tools.dump import specialize_for_dump

    x = torch.randn(2, 3, 64, 64)
    backbone = specialize_for_dump(randomize_(se_resnet9_fixup(3)).eval(), [x])
    assert inductor_work(backbone.graph_module) == []
    encoder = specialize_for_dump(bps_visual_encoder(3).eval(), [x])
    assert inductor_work(encoder.graph_module)


def test_the_inductor_copy_calls_the_kernels_through_their_ops():
    """AOTAutograd's cache bypasses a graph that calls a function it does not know: the glue
    pipeline makes the kernels' calls op calls, with the same result."""
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.passes.glue import kernels_as_library_ops

    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    gm, want = _private_graph(randomize_(se_resnet9_fixup(3)).eval(), x)
    assert se_gates(gm) == 4 and se_scales(gm) == 4 and kernels_as_library_ops(gm) == 4
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fusion_compiler.se_scale.default) == 4
    assert se_scale not in targets
    with torch.inference_mode():
        torch.testing.assert_close(gm(x), want, rtol=1e-4, atol=1e-5)


def test_a_split_into_views_is_no_inductor_work():
    """ShuffleNet's ``x.chunk(2, dim=1)`` (and ``split``, ``unbind``) return views of the region's
    output, as indexing does: no kernel for Inductor; the concatenation after them is one."""
    from fusion_compiler.tools.dump import specialize_for_dump

    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 8, 1)

        def forward(self, x):
            a, b = self.conv(x).chunk(2, dim=1)
            c, d = torch.split(x, 4, dim=1)
            return a, b, c, torch.unbind(d, 1)[0]

    spec = specialize_for_dump(Halves().eval(), [torch.randn(2, 8, 4, 4)])
    assert inductor_work(spec.graph_module) == []


def test_private_copy_of_a_parametrized_module():
    """The background compiles' copy of a graph copies its leaf modules; a parametrized one (a
    spectral-norm Linear, a leaf of the trace) refuses ``copy.copy``: every GPU compile of such a
    model failed there ("Serialization of parametrized modules is only supported through
    state_dict()"). The copy holds the same tensors and computes the same."""
    import torch.fx as fx

    from fusion_compiler.runtime.tiered import isolated_copy

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(6, 4))

        def forward(self, x):
            return torch.relu(self.fc(x))

    torch.manual_seed(0)
    model = Head().eval()
    gm = fx.symbolic_trace(model)
    copy = isolated_copy(gm, opaque=lambda m: False)
    x = torch.randn(3, 6)
    (fc,) = [m for m in copy.modules() if isinstance(m, nn.Linear)]
    assert fc is not model.fc and fc.parametrizations.weight.original is \
        model.fc.parametrizations.weight.original
    torch.testing.assert_close(copy(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("real", [False, True], ids=["meta", "real"])
def test_outputs_other_than_tensors_are_put_back_around_inductors_graph(real):
    """AOTAutograd fails on a graph that returns a ``torch.Size`` ("output spec mismatch"): the
    glue's Inductor compile failed and the eager glue stayed (GPU conformance
    ``returned_input_and_size``). The graph Inductor gets returns tensors alone; the sizes and
    numbers come back around it, in the structure the model returns: a ``torch.Size`` too after
    the real propagation the GPU pipeline runs (session 52, GPU suite: a plain tuple came
    back, pytree's map had rebuilt the recorded size as one)."""
    import torch.fx as fx

    from fusion_compiler.glue_compile import _tensor_outputs_only
    from fusion_compiler.shapes import propagate_shapes

    class Sizes(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return y, x, y.size(), {"n": y.shape[0], "z": y * 2, "s": (y.shape, 1)}

    torch.manual_seed(0)
    model, x = Sizes().eval(), torch.randn(2, 3, 8, 8)
    gm = fx.symbolic_trace(model)
    propagate_shapes(gm, [x], real=real)
    rebuild = _tensor_outputs_only(gm)
    with torch.no_grad():
        inner = gm(x)
        assert isinstance(inner, tuple) and all(isinstance(t, torch.Tensor) for t in inner)
        y, same, size, rest = rebuild(inner)
        want = model(x)
    assert isinstance(size, torch.Size) and size == want[2] and rest["n"] == 2
    assert isinstance(rest["s"][0], torch.Size) and rest["s"] == want[3]["s"]
    assert same is x and torch.equal(y, want[0]) and torch.equal(rest["z"], want[3]["z"])
    assert _tensor_outputs_only(fx.symbolic_trace(nn.Conv2d(3, 8, 3))) is None  # no meta
