"""Module hooks and a compiled graph.

A compiled graph runs its model's code as graph ops: a hook on a submodule would never be called
(and in a CUDA graph, Python runs only at capture). So the root's hooks run around the compiled
call as ``nn.Module.__call__`` runs them (:func:`call_with_hooks`), the two reparametrizations
whose pre-hooks only compute a weight (the legacy ``weight_norm`` and ``spectral_norm``) are
rewritten into the graph (:mod:`fusion_compiler.passes.pre_fusion.normalize`), and any other
hook below the root, or a global one, makes the call refuse at once (:func:`unsupported_hook`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.nn.modules import module as module_globals
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

__all__ = ["REPARAMETRIZATIONS", "unsupported_hook", "uninitialized_lazy", "hook_tables",
           "has_hooks", "call_with_hooks", "instance_forward", "uncompiled_forward"]

REPARAMETRIZATIONS = (WeightNorm, SpectralNorm)
"""Forward pre-hooks the graph computes itself (their weight, from the module's parameters)."""

_KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBALS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
            "_global_backward_hooks")
_swap = threading.RLock()
_SWAPPED: dict[int, tuple[Any, Any]] = {}  # id(module): (forward set for a call, the one before)
_NONE = object()


def _name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def unsupported_hook(module: torch.nn.Module) -> str:
    """Why a compiled graph of ``module`` cannot run, in one sentence naming the first hook it
    cannot call (``""``: none): a global module hook, or a hook on a submodule other than
    :data:`REPARAMETRIZATIONS`. A graph ``torch.compile`` handed over is named as such."""
    what, hook = _hook(module)
    if not what:
        return ""
    if isinstance(module, torch.fx.GraphModule):
        return (f"the graph torch.compile handed over has {what}: a compiled graph cannot call "
                "it; remove the hook, or call the model uncompiled")
    fix = ("for inference, make the pruning permanent (torch.nn.utils.prune.remove(module, "
           "name))" if isinstance(hook, BasePruningMethod) else "remove the hook")
    return (f"{type(module).__name__} has {what}: a compiled graph cannot call it; {fix}, or "
            "compile with torch.compile(model, backend='fusion_compiler'), which runs hooks, or "
            "call the model uncompiled")


def uninitialized_lazy(module: torch.nn.Module) -> str:
    """Why ``module`` cannot be compiled yet (``""``: it can): a lazy module below it
    (``nn.LazyConv2d``) that has not made its parameters, which it does at its first call
    (``torch.nn.modules.lazy.LazyModuleMixin``), in one sentence naming it."""
    lazy = [f"'{path}' ({type(sub).__name__})" for path, sub in module.named_modules()
            if isinstance(sub, torch.nn.modules.lazy.LazyModuleMixin)
            and sub.has_uninitialized_params()]
    if not lazy:
        return ""
    return (f"{type(module).__name__} has lazy modules that have not made their parameters yet "
            f"({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}): they make them at "
            "their first call; call the model once on an example batch, then compile it")


def _hook(module: torch.nn.Module) -> tuple[str, Any]:
    """The first hook a compiled graph of ``module`` cannot run, described, and the hook
    (``("", None)``: none)."""
    for kind in _GLOBALS:
        for hook in getattr(module_globals, kind).values():
            return (f"a global module hook ({kind.strip('_').replace('_', ' ')} {_name(hook)}), "
                    "which would run for every submodule"), hook
    for path, sub in module.named_modules():
        if not path:
            continue
        for kind in _KINDS:
            for hook in getattr(sub, kind).values():
                if kind == "_forward_pre_hooks" and isinstance(hook, REPARAMETRIZATIONS):
                    continue
                return (f"{kind.strip('_').replace('_', ' ')[:-1]} {_name(hook)} on submodule "
                        f"'{path}' ({type(sub).__name__})"), hook
    return "", None


def hook_tables(module: torch.nn.Module) -> list[dict]:
    """The hook tables a compiled graph depends on (the submodules' and the global ones): a hook
    added to any of them changes its length."""
    tables = [getattr(module_globals, kind) for kind in _GLOBALS]
    for path, sub in module.named_modules():
        if path:
            tables += [getattr(sub, kind) for kind in _KINDS]
    return tables


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself has a forward, pre-forward or backward hook."""
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def call_with_hooks(module: torch.nn.Module, forward: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` called as ``module(*args, **kwargs)`` would call
    ``module.forward``: its pre-hooks first (which may replace the arguments), its forward hooks
    after (which may replace the output), its backward hooks on the gradients. PyTorch's own
    ``nn.Module.__call__`` does it, with ``forward`` in place of ``module.forward`` for this one
    call (an instance attribute, set under a lock, then put back as it was)."""
    with _swap:
        before = vars(module).get("forward", _NONE)  # a forward the user set on the instance
        outer = _SWAPPED.get(id(module))  # a hook calling the model again nests the swaps
        _SWAPPED[id(module)] = (forward, before)
        module.forward = forward
        try:
            return module(*args, **kwargs)
        finally:
            if before is _NONE:
                del module.forward
            else:
                module.forward = before
            if outer is None:
                del _SWAPPED[id(module)]
            else:
                _SWAPPED[id(module)] = outer


def instance_forward(module: torch.nn.Module) -> Any:
    """The ``forward`` set on ``module``'s instance (``module.forward = f``: what
    ``nn.Module.__call__`` runs instead of the class's), or ``None``: none, or one that is the
    class's own bound to the module (what removing an offloading hook leaves). The one
    :func:`call_with_hooks` sets for the length of a call is seen through."""
    forward = vars(module).get("forward")
    swapped = _SWAPPED.get(id(module))
    if swapped is not None and swapped[0] is forward:
        forward = None if swapped[1] is _NONE else swapped[1]
    if (forward is not None and getattr(forward, "__self__", None) is module
            and getattr(forward, "__func__", None) is getattr(type(module), "forward", None)):
        return None
    return forward


def uncompiled_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """What ``module.forward`` is outside :func:`call_with_hooks`: the forward to run a call
    uncompiled with, also from inside that call (where ``module.forward`` is the compiled one)."""
    return instance_forward(module) or type(module).forward.__get__(module)
