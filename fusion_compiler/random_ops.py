"""Random ops while a model is compiled: none draws from the user's generators.

A compile runs parts of the model's code before any compiled call: ``torch.fx`` runs
``forward``'s Python code to trace it, and shape propagation runs the traced graph once on copies
of the inputs. A random op there would take numbers from the process's generators, which are the
user's program's (and another thread's, drawing meanwhile), and one with constant arguments
(``torch.randn(3, 1, 1, 1)``) would be run once at trace time, its result kept in the graph as a
constant that every compiled call adds again. Here:

* :class:`RandomCallsAsNodes` (during a trace) makes a random call whose arguments hold no traced
  value a node of the graph, as a call with traced arguments is: it draws afresh at every call;
* :class:`NoDraws` (during a propagation on real tensors, around the nodes that
  :func:`may_draw`) answers random ops with zeros of the shape, dtype and strides they would
  have;
* :func:`python_random` tells which names ``forward`` reads draw Python's or NumPy's numbers,
  which a trace cannot make nodes of, and :func:`random_state` reads their generators' states:
  :func:`~fusion_compiler.capture.capture` refuses those the trace drew from.

PyTorch marks the ops that draw with the tag ``torch.Tag.nondeterministic_seeded`` (dropout,
``rand``, ``bernoulli_``, ``multinomial``, ``normal_``...): the test used here. Both modes are
the calling thread's only (PyTorch keeps dispatch and function modes per thread). History:
docs/decisions.md, "A compile draws no random numbers from the user's generators".
"""

from __future__ import annotations

import pickle
import random
import types
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from .ir.ops import meta_like

__all__ = ["NoDraws", "RandomCallsAsNodes", "draws", "may_draw", "python_random", "random_state"]


def _draws(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class NoDraws(TorchDispatchMode):
    """Within the block, a random op returns zeros of the shape, dtype and strides its meta
    function gives, on its device (an in-place one fills its tensor with zeros; one without a
    meta function gives zeros shaped as its first tensor argument); every other op runs. The
    default generators and any generator passed to the op are left as they were.

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
        meta_args, meta_kwargs = tree_map_only(  # (a generator stays out of a meta run)
            torch.Tensor, meta_like, tree_map_only(torch.Generator, lambda g: None, (args, kwargs)))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = "meta"
        try:
            out = func(*meta_args, **meta_kwargs)
        except NotImplementedError:  # no meta function (binomial): its input's shape
            if not real:
                raise
            return torch.zeros_like(real[0])
        metas = [a for a in tree_leaves((meta_args, meta_kwargs)) if isinstance(a, torch.Tensor)]
        same = {id(m): r for m, r in zip(metas, real)}  # what an in-place op returns

        def real_value(m: torch.Tensor) -> torch.Tensor:
            if id(m) in same:  # (the run's own copy: inputs and state the graph writes are)
                return same[id(m)].zero_()
            return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_()

        return tree_map_only(torch.Tensor, real_value, out)


_DETERMINISTIC = frozenset("""
    conv1d conv2d conv3d conv_transpose2d linear bilinear relu relu_ relu6 silu silu_ gelu elu
    leaky_relu hardtanh hardswish hardsigmoid sigmoid sigmoid_ tanh softplus mish softmax
    log_softmax add add_ sub sub_ mul mul_ div div_ truediv floordiv neg pow sqrt rsqrt exp log
    abs clamp clamp_ clip matmul bmm mm addmm einsum cat stack flatten unflatten view view_as
    reshape permute transpose contiguous size dim getitem getattr to float half bfloat16 type_as
    mean sum amax amin max min adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool2d
    avg_pool2d max_pool2d batch_norm layer_norm group_norm instance_norm normalize pad
    interpolate chunk split unsqueeze squeeze expand expand_as narrow repeat where masked_fill
    zeros_like ones_like full_like new_zeros new_ones new_empty empty_like iadd isub imul itruediv
    eq ne lt le gt ge and_ or_ detach clone pixel_shuffle channel_shuffle
""".split())
"""Names of call targets that never draw (their runs need no :class:`NoDraws`)."""

_DRAWING_MODULES = ("Dropout", "RReLU", "RNN", "LSTM", "GRU", "Transformer", "MultiheadAttention")
_DRAWING_OPS = frozenset("""
    dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout native_dropout
    rrelu rand rand_like randn randn_like randint randint_like randperm bernoulli normal
    multinomial poisson uniform_ normal_ bernoulli_ exponential_ cauchy_ geometric_ log_normal_
    random_ stochastic_depth gumbel_softmax feature_dropout dropout_ alpha_dropout_
    feature_alpha_dropout_ rrelu_ rrelu_with_noise fractional_max_pool2d fractional_max_pool3d
    fractional_max_pool2d_with_indices fractional_max_pool3d_with_indices""".split())


def draws(node: fx.Node) -> bool:
    """Whether ``node`` calls an op known to draw random numbers (dropout, ``torch.rand``,
    ``x.uniform_()``: :data:`_DRAWING_OPS`, by name; where it may not, as dropout in eval
    mode, it still counts). Narrower than :func:`may_draw`, which counts what is not known
    not to draw."""
    return node.op in ("call_function", "call_method") and _name(node) in _DRAWING_OPS


def may_draw(node: fx.Node, root: torch.nn.Module) -> bool:
    """Whether running ``node`` (of a graph of ``root``) may draw random numbers: a call of a
    target not known not to (a ``torch.nn`` leaf module other than dropout, RReLU, recurrent,
    transformer and attention layers; an op named in :data:`_DETERMINISTIC`). A run needs
    :class:`NoDraws` only around these (the mode costs Python work at every op)."""
    if node.op == "call_module":
        cls = type(root.get_submodule(node.target))
        return not cls.__module__.startswith("torch.nn.") or any(
            k in cls.__name__ for k in _DRAWING_MODULES)
    return node.op in ("call_function", "call_method") and _name(node) not in _DETERMINISTIC


def _name(node: fx.Node) -> str:
    """A call's target by name (a method's, a function's ``__name__``)."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


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

    Raises:
        RuntimeError: (the trace fails with it) a call passes a ``torch.Generator`` of its own,
            with traced arguments or not (fx kept it as an opaque attribute of the graph, and the
            capture then named that attribute as assigned), which a graph cannot hold.

    Args:
        tracer: the ``torch.fx.Tracer`` whose trace the block runs."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, torch.Generator) for a in leaves):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} draws from a torch.Generator passed to it: a "
                "compiled graph cannot hold one; draw from the default generator")
        if any(isinstance(a, fx.Proxy) for a in leaves):
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
    ``RandomState`` or a method of one. Reads no attribute an object could serve by code of its
    own (``__getattr__``): only those of modules, functions, methods and classes."""
    if isinstance(value, types.ModuleType):
        return value.__name__ in ("random", "numpy.random")
    owner = value.__self__ if isinstance(value, _METHODS) else value
    where = [type(owner).__module__ or ""]
    if isinstance(value, _FUNCTIONS):
        where.append(value.__module__ or "")
    return isinstance(owner, random.Random) or any(
        m == "random" or m.startswith("numpy.random") for m in where)


_METHODS = (types.MethodType, types.BuiltinMethodType)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, type)


def random_state(value: Any) -> bytes | None:
    """The state of the random numbers ``value`` (:func:`python_random`) draws from, pickled: a
    ``random.Random``'s, a NumPy ``Generator``'s or ``RandomState``'s, or the module-level one of
    ``random`` or ``numpy.random``; ``None`` where it cannot be read."""
    owner = value if isinstance(value, types.ModuleType) else getattr(value, "__self__", value)
    for read in (lambda o: o.getstate(), lambda o: o.bit_generator.state,
                 lambda o: o.get_state()):
        try:
            return pickle.dumps(read(owner))
        except Exception:  # noqa: BLE001 - not this kind of generator
            continue
    return None
