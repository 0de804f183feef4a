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
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.nn as nn

__all__ = ["ParametrizedCall", "TRACED_THROUGH", "traced_through", "parametrized_calls"]

TRACED_THROUGH = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d, nn.Linear, nn.Bilinear, nn.Embedding, nn.LayerNorm,
                  nn.GroupNorm, nn.PReLU)
"""``torch.nn`` modules whose ``forward`` fx traces (no control flow on tensors): parametrized,
they are traced through, so the convolutions among them can fuse."""


def traced_through(module: nn.Module) -> bool:
    """Whether a trace goes through the parametrized ``module`` (its class is one
    ``parametrize`` derived from a :data:`TRACED_THROUGH` class, or a class of the user's, which
    fx traces through anyway), rather than keeping it as a leaf."""
    base = type(module).__bases__[0]  # parametrize's class derives from the module's own
    return issubclass(base, TRACED_THROUGH) or not base.__module__.startswith(
        ("torch.nn.", "torch.ao.nn."))


class ParametrizedCall(nn.Module):
    """A call of the parametrized module ``wraps`` (a submodule, so that a run of the graph on
    copies of the model's state, as a shape propagation makes, runs it on the copies): its
    parametrized tensors computed from their originals by their ``ParametrizationList`` s,
    never read from ``parametrize.cached()``'s cache, then its own class's ``forward`` run with
    them. Impure: never removed or hoisted (a ``spectral_norm`` updates its
    vectors in training)."""

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
    from torch.nn.utils import parametrize  # noqa: PLC0415

    changed = False
    for node in gm.graph.find_nodes(op="call_module"):
        module = gm.get_submodule(node.target)
        if parametrize.is_parametrized(module):
            name = f"{str(node.target).replace('.', '_')}_parametrized"
            if not hasattr(gm, name):
                gm.add_submodule(name, ParametrizedCall(module))
            node.target, changed = name, True
    if changed:
        gm.recompile()
