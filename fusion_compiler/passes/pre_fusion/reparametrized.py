"""The weight a convolution's ``forward`` sees when a reparametrization computes it: the legacy
``weight_norm`` and ``spectral_norm`` pre-hooks (a graph runs no hooks, so ``normalize`` writes
what they compute as graph ops), and ``torch.nn.utils.parametrizations.weight_norm``'s
parametrization, which the trace keeps as a call of its module (written as its op)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ...ir.ops import attribute

__all__ = ["conv_weight", "is_weight_norm"]


def is_weight_norm(mod: nn.Module) -> bool:
    """Whether ``mod`` is the parametrization ``torch.nn.utils.parametrizations.weight_norm``
    registers (its ``forward(g, v)`` is ``torch._weight_norm(v, g, dim)``); the tracer traces a
    parametrized module down to its parametrizations, which stay leaves."""
    return (type(mod).__name__ == "_WeightNorm"
            and type(mod).__module__ == "torch.nn.utils.parametrizations")


class _SpectralNormWeight(nn.Module):
    """The weight a legacy ``spectral_norm`` pre-hook computes before each forward of ``module``
    (a power iteration step that updates its ``u`` and ``v`` buffers in place in training mode,
    as the hook does), as a graph op. Its tensors (the weight before normalization, ``u``,
    ``v``) are the op's arguments, so a run of the graph on copies of the module's state (shape
    propagation) writes the copies. Impure: never removed or hoisted."""

    _is_impure = True

    def __init__(self, module: nn.Module, hook: Any):
        super().__init__()
        object.__setattr__(self, "target", module)  # not registered: the model owns it
        self.hook = hook

    def forward(self, orig: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        name = self.hook.name  # compute_weight reads these three attributes of the module
        tensors = _Tensors()
        setattr(tensors, f"{name}_orig", orig)
        setattr(tensors, f"{name}_u", u)
        setattr(tensors, f"{name}_v", v)
        return self.hook.compute_weight(tensors, do_power_iteration=self.target.training)


class _Tensors:
    """Named tensors, read as a module's attributes (a plain class: Dynamo traces it, Inductor's
    compile of the glue runs this op)."""


def conv_weight(gm: fx.GraphModule, path: str, mod: nn.Module) -> fx.Node | None:
    """The node computing ``mod.weight`` as ``mod``'s forward sees it: the parameter, or what a
    legacy ``weight_norm`` / ``spectral_norm`` pre-hook computes from its parameters (the graph
    runs no hooks); ``None`` when another pre-hook would change it."""
    from torch.nn.utils.spectral_norm import SpectralNorm  # noqa: PLC0415
    from torch.nn.utils.weight_norm import WeightNorm  # noqa: PLC0415

    g = gm.graph
    hooks = [h for h in mod._forward_pre_hooks.values()]
    if not hooks:
        return attribute(g, f"{path}.weight")
    if len(hooks) != 1 or getattr(hooks[0], "name", None) != "weight":
        return None
    hook = hooks[0]
    if isinstance(hook, WeightNorm):
        return g.call_function(torch._weight_norm, (attribute(g, f"{path}.weight_v"),
                                                     attribute(g, f"{path}.weight_g"), hook.dim))
    if isinstance(hook, SpectralNorm):
        name = path.replace(".", "_") + "_spectral_norm_weight"
        if not hasattr(gm, name):
            gm.add_submodule(name, _SpectralNormWeight(mod, hook))
        return g.call_module(name, tuple(attribute(g, f"{path}.{hook.name}_{part}")
                                         for part in ("orig", "u", "v")))
    return None
