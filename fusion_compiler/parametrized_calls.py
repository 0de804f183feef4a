"""Calls of parametrized modules (``torch.nn.utils.parametrize``) that a trace keeps as leaves,
made to compute their parametrized tensors without torch's properties.

A parametrized module's tensors (``module.weight``) are properties that go through
``parametrize.cached()``'s cache, one per process, shared by every thread. A graph runs on the
caller's thread and, on the GPU, on the package's background thread too (a CUDA-graph capture's
warm-ups): a leaf reading them there took the caller's cached tensor (whose autograd graph the
caller's backward may have freed) or left its own in the caller's cache. So the tracer traces
parametrized modules through where it can (:data:`TRACED_THROUGH`: the graph computes the
tensors from their originals), and each call of one it keeps (a batch norm, whose ``forward``
checks its input with control flow fx cannot trace) becomes a call of :class:`ParametrizedCall`.
Inside ``parametrize.cached()`` eager computes the tensors once per block, which a graph cannot
repeat: the compiled module runs such calls uncompiled (:func:`in_cached_block`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.fx as fx
import torch.nn as nn
from torch.nn.utils import parametrize

__all__ = ["ParametrizedCall", "TRACED_THROUGH", "traced_through", "parametrized_calls",
           "uncached", "in_cached_block"]

TRACED_THROUGH = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Bilinear, nn.Embedding,
                  nn.LayerNorm, nn.GroupNorm, nn.PReLU)
"""``torch.nn`` modules whose ``forward`` fx traces (no control flow on tensors): parametrized,
they are traced through, so the convolutions among them can fuse. (Not the transposed
convolutions: ``output_size=`` makes their ``forward`` compare the input's sizes.)"""


def traced_through(module: nn.Module) -> bool:
    """Whether a trace goes through the parametrized ``module``: its ``forward`` is a
    :data:`TRACED_THROUGH` class's or one written outside ``torch.nn`` (which fx traces through
    anyway), not another ``torch.nn`` module's (``class MyBN(nn.BatchNorm2d)`` has batch norm's),
    which stays a leaf."""
    owner = next(c for c in type(module).__mro__ if "forward" in vars(c))
    return issubclass(owner, TRACED_THROUGH) or not owner.__module__.startswith(
        ("torch.nn.", "torch.ao.nn."))


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """No caching of parametrized tensors while a trace runs the model's code: inside the
    caller's ``parametrize.cached()``, the property put the trace's proxy (or a weight made
    without gradients) in the cache, which the caller then read. The cache itself is left as it
    is (with caching off nothing is added)."""
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled = 0
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled


def in_cached_block(model: nn.Module) -> bool:
    """Whether the caller is inside ``parametrize.cached()`` and ``model`` has parametrized
    tensors: eager then computes each once per block (a spectral norm's power iteration once;
    an original written in place inside the block not seen), where a compiled graph computes
    them at every call, so such calls run the model uncompiled."""
    return bool(parametrize._cache_enabled) and any(
        parametrize.is_parametrized(m) for m in model.modules())


class ParametrizedCall(nn.Module):
    """A call of the parametrized module ``wraps`` (a submodule, so that a run of the graph on
    copies of the model's state, as a shape propagation makes, runs it on the copies): its
    parametrized tensors computed from their originals by their ``ParametrizationList`` s,
    never read from ``parametrize.cached()``'s cache, then its own class's ``forward`` run with
    them. Impure: never removed or hoisted (a ``spectral_norm`` updates its vectors in
    training)."""

    _is_impure = True

    def __init__(self, wraps: nn.Module):
        super().__init__()
        self.wraps = wraps  # (ir.aliasing.called_module reads it)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = self.wraps
        plain = object.__new__(type(module).__bases__[0])  # its class before parametrize's
        plain.__dict__.update(vars(module))
        tensors = {name: chain() for name, chain in module.parametrizations.items()}
        object.__setattr__(plain, "_parameters", {**module._parameters, **tensors})
        return plain.forward(*args, **kwargs)  # (a submodule's hooks are refused: StateGuard)


def parametrized_calls(gm: fx.GraphModule) -> None:
    """Make each ``call_module`` node of ``gm`` whose module is parametrized a call of a
    :class:`ParametrizedCall` of it (a submodule of ``gm``, named after the module's path)."""
    made: dict[int, str] = {}  # id of a module -> its wrapper's name
    for node in gm.graph.find_nodes(op="call_module"):
        module = gm.get_submodule(node.target)
        if parametrize.is_parametrized(module):
            if id(module) not in made:
                base = f"{str(node.target).replace('.', '_')}_parametrized"
                name, n = base, 1
                while hasattr(gm, name):  # (a module of the model's may have that name)
                    name, n = f"{base}_{n}", n + 1
                gm.add_submodule(name, ParametrizedCall(module))
                made[id(module)] = name
            node.target = made[id(module)]
    if made:
        gm.recompile()
