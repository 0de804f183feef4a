"""A compile draws nothing from the user's generators, and random calls stay random: a trace
makes a random call on constants a node (it ran once and its numbers were kept), shape
propagation on real inputs answers random ops with zeros (it saved and restored the generators,
undoing another thread's draws), and Python's or NumPy's random numbers in ``forward`` are
refused (a trace cannot make them nodes)."""

import random
import threading

import numpy as np
import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler
from fusion_compiler.capture import capture
from fusion_compiler import FusionError
from fusion_compiler.shapes import propagate_shapes

_DRAWN: list[torch.Tensor] = []


@torch.fx.wrap
def _drawn_on_another_thread(x):
    """Another thread draws while the graph runs (as an RL learner beside a compiling actor)."""
    thread = threading.Thread(target=lambda: _DRAWN.append(torch.rand(4)))
    thread.start()
    thread.join()
    return x


class _Draws(nn.Module):
    def forward(self, x):
        x = _drawn_on_another_thread(x)
        y = F.dropout(x, 0.5, training=True) + torch.rand_like(x) + torch.randn(3, 1, 1, 1)
        return y * torch.empty_like(y).bernoulli_(0.3), torch.multinomial(x.flatten(1).abs() + 1, 2)


def test_propagation_on_real_inputs_draws_nothing_and_undoes_no_other_thread_draw():
    gm, x = capture(_Draws()), torch.randn(3, 4, 5, 5)
    torch.manual_seed(0)
    want = torch.rand(4), torch.rand(4)
    torch.manual_seed(0)
    _DRAWN.clear()
    propagate_shapes(gm, [x], real=True)
    assert torch.equal(_DRAWN[0], want[0])  # the graph's own random ops drew nothing
    assert torch.equal(torch.rand(4), want[1])  # and the other thread's draw was not undone
    shapes = {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}
    assert shapes["randn"] == (3, 1, 1, 1) and shapes["multinomial"] == (3, 2)
    assert shapes["bernoulli_"] == (3, 4, 5, 5)


class _ConstantNoise(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv(x)) + torch.randn(4, 1, 1)


def test_a_random_call_on_constants_is_a_node_and_the_trace_draws_nothing():
    model = _ConstantNoise()
    state = torch.get_rng_state()
    gm = capture(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(torch.randn) == 1
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and "constant" in str(n.target)]


def test_compiled_noise_on_constants_is_drawn_at_each_call_as_eager_draws_it():
    model, x = _ConstantNoise(), torch.randn(2, 4, 6, 6)
    compiled = fusion_compiler.compile(model)
    for seed in range(3):
        torch.manual_seed(seed)
        want = model(x), model(x)
        torch.manual_seed(seed)
        got = compiled(x), compiled(x)
        assert not torch.equal(got[0], got[1])
        torch.testing.assert_close(got, want)


_NUMPY = np.random.default_rng(0)


@pytest.mark.parametrize("draw, name", [
    (lambda: random.random(), "random"),
    (lambda: np.random.rand(), "np.random"),
    (lambda: _NUMPY.random(), "_NUMPY"),
])
def test_python_or_numpy_random_numbers_drawn_by_the_trace_are_refused(draw, name):
    global _DRAW
    _DRAW = draw

    class Jitter(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(x) * _DRAW()

    with pytest.raises(FusionError, match=f"draws random numbers with Python's or NumPy's.*{name}"):
        fusion_compiler.compile(Jitter())(torch.randn(1, 4, 5, 5))


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)


class _OwnRandom(_Base):
    def __init__(self):
        super().__init__()
        self.rng = random.Random(0)

    def forward(self, x):
        return self.conv(x) * self.rng.random()


class _ImportedInForward(_Base):
    def forward(self, x):
        import random as r

        return self.conv(x) * r.random()


class _LayerDrop(_Base):
    def forward(self, x):
        if self.training and random.random() < 0.5:
            return x
        return self.conv(x)


@pytest.mark.parametrize("model, eval_compiles", [
    (_OwnRandom, False), (_ImportedInForward, False), (_LayerDrop, True)])
def test_python_random_numbers_are_refused_where_the_trace_draws_them(model, eval_compiles):
    """Held by the module, imported inside forward: refused. A draw in a branch the trace does
    not take (LayerDrop in eval mode) draws nothing: compiled; in training mode, refused."""
    x = torch.randn(1, 4, 5, 5)
    m = model().eval()
    if eval_compiles:
        torch.testing.assert_close(fusion_compiler.compile(m)(x), m(x))
    else:
        with pytest.raises(FusionError, match="Python's or NumPy's"):
            fusion_compiler.compile(m)(x)
    with pytest.raises(FusionError, match="Python's or NumPy's"):
        fusion_compiler.compile(model().train())(x)


class _WritesConstant(_Base):
    def __init__(self, how):
        super().__init__()
        self.how, self.s = how, nn.Parameter(torch.full((4, 1, 1), 2.0))

    def forward(self, x):
        w = torch.ones(4, 1, 1)
        if self.how == "mul_":
            w.mul_(self.s)
        elif self.how == "split":  # a view the trace records (its size is traced)
            w.split(x.shape[1] // 2)[0].mul_(self.s[:2])
        elif self.how == "unflatten":  # a view no table listed (helper-51)
            torch.unflatten(w, 0, (x.shape[1] // 2, 2)).mul_(2.0)
        else:
            w[torch.randperm(4)[:1]] = 0
        return self.conv(x) * w


@pytest.mark.parametrize("how", ["mul_", "setitem", "split", "unflatten"])
def test_a_write_into_a_tensor_made_from_constants_is_refused(how):
    """The trace makes ``torch.ones(4, 1, 1)`` once: written in place at every compiled call,
    the writes added up (mul_, and through a split: the check's own list of views lacked it)
    or were lost (an item assignment)."""
    with pytest.raises(FusionError, match="writes in place into a tensor it makes from constant"):
        fusion_compiler.compile(_WritesConstant(how))(torch.randn(1, 4, 5, 5))


class _OwnGenerator(_Base):
    def __init__(self, traced):
        super().__init__()
        self.traced, self.g = traced, torch.Generator().manual_seed(0)

    def forward(self, x):
        y = self.conv(x)
        return y + torch.randn(y.shape if self.traced else (4, 1, 1), generator=self.g)


@pytest.mark.parametrize("traced", [False, True], ids=["constant_size", "traced_size"])
def test_a_random_call_with_its_own_generator_is_refused_naming_it(traced):
    """With a traced size the refusal named '_opaque_obj0', fx's attribute for the generator, as
    an assignment on the module (helper-50)."""
    with pytest.raises(FusionError, match="randn draws from a torch.Generator passed to it"):
        fusion_compiler.compile(_OwnGenerator(traced))(torch.randn(1, 4, 5, 5))


def test_no_draws_fills_in_place_draws_with_zeros_and_shapes_ops_without_meta_functions():
    from fusion_compiler.random_ops import NoDraws

    state = torch.get_rng_state()
    with NoDraws():
        filled = torch.empty(5).uniform_()
        dropped = F.dropout(torch.ones(2, 3), 0.5, training=True)
        counts = torch.binomial(torch.full((2, 3), 4.0), torch.full((2, 3), 0.5))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(filled, torch.zeros(5)) and torch.equal(dropped, torch.zeros(2, 3))
    assert counts.shape == (2, 3)


class _DropoutCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def body(self, x):
        return F.dropout(torch.relu(self.conv(x)), 0.5, self.training)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.body, x, use_reentrant=False).mean((2, 3))


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_dropout_inside_a_checkpoint_recomputes_the_same_mask(door):
    """Dynamo's checkpoint op run as it is recomputed the body in the backward with other
    random numbers: the gradient took another dropout mask (0.17 off on a weight gradient of
    0.29, as with ``backend="eager"``). Such a body is inlined (its activations kept)."""
    import copy

    torch.manual_seed(0)
    model, x = _DropoutCheckpointed().train(), torch.randn(2, 3, 16, 16)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    run = fusion_compiler.compile(twin) if door == "compile" else torch.compile(
        twin, backend="fusion_compiler")
    for m, fn in ((model, model), (twin, run)):
        torch.manual_seed(1)
        fn(x).square().sum().backward()
    torch.testing.assert_close(twin.conv.weight.grad, model.conv.weight.grad, rtol=1e-5,
                               atol=1e-6)
