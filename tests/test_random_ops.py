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
def test_python_or_numpy_random_numbers_in_forward_are_refused(draw, name):
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
