"""Random ops while a model is compiled: none draws from the user's generators.

A compile runs parts of the model's code before any compiled call: ``torch.fx`` runs
``forward``'s Python code to trace it, and shape propagation runs the traced graph once on copies
of the inputs. A random op there would take numbers from the process's generators, which are the
user's program's (and another thread's, drawing meanwhile), and one with constant arguments
(``torch.randn(3, 1, 1, 1)``) would be run once at trace time, its result kept in the graph as a
constant that every compiled call adds again. Here:

* :class:`RandomCallsAsNodes` (during a trace) makes a random call whose arguments hold no traced
  value a node of the graph, as a call with traced arguments is: it draws afresh at every call;
* :class:`NoDraws` (during a propagation on real tensors) answers random ops with zeros of the
  shape, dtype and strides they would have;
* :func:`python_random` tells which names ``forward`` reads draw Python's or NumPy's numbers,
  which a trace cannot make nodes of: :func:`~fusion_compiler.capture.capture` refuses them.

PyTorch marks the ops that draw with the tag ``torch.Tag.nondeterministic_seeded`` (dropout,
``rand``, ``bernoulli_``, ``multinomial``, ``normal_``...): the test used here. Both modes are
the calling thread's only (PyTorch keeps dispatch and function modes per thread). History:
docs/decisions.md, "A compile draws no random numbers from the user's generators".
"""

from __future__ import annotations

import random
import types
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["NoDraws", "RandomCallsAsNodes", "python_random"]


def _draws(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _to_meta(value: Any) -> Any:
    """A meta tensor with ``value``'s shape, dtype and strides; ``None`` for a generator."""
    if isinstance(value, torch.Generator):
        return None
    if value.device.type == "meta":
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


class NoDraws(TorchDispatchMode):
    """Within the block, a random op returns zeros of the shape, dtype and strides its meta
    function gives, on its device (an in-place one returns its tensor unchanged); every other
    op runs. The default generators and any generator passed to the op are left as they were.

    Why not save the generators' states and restore them after the run
    (``torch.random.fork_rng``): the default generators are the process's. Another thread's draws
    in between would be undone by the restore and drawn again after it, the same numbers."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's handler in a Dynamo "disable", which imports Dynamo (seconds) at
        # the first op; this handler runs no compiled code
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _draws(func):
            return func(*args, **kwargs)
        real = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        device = kwargs.get("device") or (real[0].device if real else torch.get_default_device())
        meta_args, meta_kwargs = tree_map_only((torch.Tensor, torch.Generator), _to_meta,
                                               (args, kwargs))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = "meta"
        out = func(*meta_args, **meta_kwargs)
        metas = [a for a in tree_leaves((meta_args, meta_kwargs)) if isinstance(a, torch.Tensor)]
        same = {id(m): r for m, r in zip(metas, real)}  # what an in-place op returns

        def real_value(m: torch.Tensor) -> torch.Tensor:
            if id(m) in same:
                return same[id(m)]
            return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_()

        return tree_map_only(torch.Tensor, real_value, out)


class _Draw(Exception):
    """Raised (and caught) before a random op runs: see :class:`RandomCallsAsNodes`."""


class _StopAtDraw(TorchDispatchMode):
    _should_skip_dynamo = NoDraws._should_skip_dynamo

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if _draws(func):
            raise _Draw
        return func(*args, **(kwargs or {}))


class RandomCallsAsNodes(TorchFunctionMode):
    """During ``tracer``'s trace, a call of a torch function or tensor method whose arguments
    hold no ``fx.Proxy`` (``torch.randn(3, 1, 1, 1)``, ``torch.empty(4).uniform_()``) runs as
    eager runs it unless it reaches a random op: then, before anything is drawn, it becomes a
    node of the graph (``call_function``, or ``call_method`` for a tensor method), its tensor
    arguments constants of the graph. Calls with traced arguments are fx's, as before.

    Args:
        tracer: the ``torch.fx.Tracer`` whose trace the block runs."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        try:
            with _StopAtDraw():
                return func(*args, **kwargs)
        except _Draw:
            pass
        name = getattr(func, "__name__", None)
        if name is not None and getattr(torch.Tensor, name, None) is func:
            return self.tracer.create_proxy("call_method", name, args, kwargs)
        return self.tracer.create_proxy("call_function", func, args, kwargs)


def python_random(value: Any) -> bool:
    """Whether ``value`` draws from Python's or NumPy's random numbers: the ``random`` or
    ``numpy.random`` module, one of their functions, a ``random.Random``, NumPy ``Generator`` or
    ``RandomState`` or a method of one."""
    if isinstance(value, types.ModuleType):
        return value.__name__ in ("random", "numpy.random")
    owner = getattr(value, "__self__", value)
    where = (getattr(value, "__module__", None) or "", type(owner).__module__ or "")
    return isinstance(owner, random.Random) or any(
        m == "random" or m.startswith("numpy.random") for m in where)
