"""normalize: bring a captured graph to the canonical, SSA form of :mod:`fusion_compiler.ir.ops`.

Rewrites, in this order:

1. **functionalize** (:mod:`.functionalize`) -- every in-place op becomes its out-of-place
   twin, and writes into graph inputs and buffers are copied back at the end. Afterwards each
   value is written once (SSA).
2. **specialize shapes** -- shape arithmetic (``x.shape``, ``x.size(1)``, ``H // 4``,
   ``1 / (h * w)``) and integer inputs (the ``SymInt`` sizes Dynamo passes to a graph with a
   dynamic batch) become constants: a compiled graph is specialized on its input shapes and
   integer values anyway.
3. **modules to functions** -- ``nn.Conv2d``,
   ``nn.ReLU``/``ReLU6``/``Hardtanh``/``Sigmoid``/``Hardsigmoid``/``Tanh``/``SiLU``/``Hardswish``,
   ``nn.BatchNorm2d``, ``nn.AvgPool2d``,
   ``nn.AdaptiveAvgPool2d(1)`` and ``nn.Identity`` become function calls (a train-mode
   ``BatchNorm2d(momentum=None)`` :func:`.batch_norm.cumulative_batch_norm`); other modules stay
   as ``call_module``.
4. **canonical calls** -- ``conv2d(x, w, b)`` -> ``conv2d(x, w, None)`` +
   ``add(., b.reshape(1,K,1,1))``; operators and methods (``x + y``, ``x.mul(y)``) ->
   ``torch.add``/``torch.mul``/..., written one way (:mod:`.arithmetic`: operand order,
   ``alpha``, negations, broadcasts); ``relu6``/``hardtanh``/``clamp`` -> ``torch.clamp``, and
   ``clamp(x, min=0)``/``clamp_min(x, 0)`` -> ``torch.relu`` (not where the graph may be
   differentiated); ``special.expit`` -> ``sigmoid``;
   ``mean``/``adaptive_avg_pool2d(., 1)`` over H, W, a whole-window ``avg_pool2d`` and a
   ``mean`` of H, W flattened (:mod:`.squeeze`) -> ``sum(x, [2, 3], keepdim=True) * (1 / (H*W))``;
   ``torch._weight_norm`` -> its formula.

Nodes it cannot bring to canonical form are left as they are (they will run in PyTorch).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.node import map_aggregate

from ...ir.ops import (CONV, HW_DIMS, attribute, calls_named, eliminate_dead_code,
                       tensor_shape, writes_in_place)
from .arithmetic import canonical_binary
from .batch_norm import cumulative_batch_norm
from .reparametrized import conv_weight, is_weight_norm
from .squeeze import flattened_hw, spatial_reduction, whole_window_pool
from .functionalize import functionalize, inplace_target

__all__ = ["normalize", "inplace_target"]

_METHODS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
            "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "clamp": torch.clamp,
            "clip": torch.clamp, "clamp_min": torch.clamp_min}
_FUNCS = {operator.add: torch.add, operator.sub: torch.sub, operator.mul: torch.mul,
          operator.truediv: torch.div, torch.add: torch.add, torch.sub: torch.sub,
          torch.mul: torch.mul, torch.div: torch.div, torch.relu: torch.relu, F.relu: torch.relu,
          torch.sigmoid: torch.sigmoid, F.sigmoid: torch.sigmoid, torch.tanh: torch.tanh,
          F.tanh: torch.tanh, torch.clamp: torch.clamp, torch.clip: torch.clamp, F.silu: F.silu,
          torch.special.expit: torch.sigmoid, torch.clamp_min: torch.clamp_min}


def normalize(gm: fx.GraphModule, differentiable: bool = True) -> fx.GraphModule:
    """Rewrite ``gm`` in place into canonical SSA form (see the module docstring) and return it.
    ``differentiable``: the graph may be differentiated (a training target); then
    ``clamp(x, min=0)`` stays a clamp, whose gradient at ``x == 0`` is 1 where ReLU's is 0.

    Needs ``node.meta["val"]`` from :func:`fusion_compiler.shapes.propagate_shapes`. A graph
    whose in-place ops cannot be made out of place (:func:`.functionalize.functionalize`) keeps
    them and gets ``gm.meta["fusion_off"]``, the reason: no region is formed in it; so does a
    graph that enters a ``torch.autocast`` block (a Dynamo graph of a forward holding one), left
    as it is: the autocast pass's casts, and a convolution's bias made an add, would change the
    dtypes autocast gives it.
    """
    if any(calls_named(n, "_enter_autocast") for n in gm.graph.nodes):
        gm.meta["fusion_off"] = ("the graph enters a torch.autocast block (Dynamo keeps a "
                                 "forward's block as ops): its ops keep autocast's rules as "
                                 "PyTorch runs them")
        return gm  # left as it is: a rewrite (conv2d's bias as an add) would change dtypes
    kept = functionalize(gm)
    if kept:  # the graph keeps its in-place ops and runs as PyTorch ops
        gm.meta["fusion_off"] = kept
    _specialize_shapes(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            _module_to_function(gm, node)
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method"):
            _canonicalize_call(gm, node, differentiable)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- shapes

def _specialize_shapes(gm: fx.GraphModule) -> None:
    def is_static(v: Any) -> bool:
        return isinstance(v, (int, torch.Size)) or (
            isinstance(v, tuple) and all(isinstance(i, int) for i in v))

    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method", "placeholder") \
                or "val" not in node.meta:
            continue
        val = node.meta["val"]
        if isinstance(val, bool) or not (is_static(val) or _folded_number(node, val)):
            continue
        const = tuple(val) if isinstance(val, torch.Size) else val
        for user in list(node.users):
            if isinstance(val, tuple) and (user.op == "output" or isinstance(user.target, type)):
                continue  # returned (or kept in a namedtuple), a torch.Size stays one: as an
                # fx constant it would be a plain tuple
            user.args = map_aggregate(user.args, lambda a: const if a is node else a)
            user.kwargs = map_aggregate(user.kwargs, lambda a: const if a is node else a)
    eliminate_dead_code(gm.graph)


_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
               operator.neg, operator.pow}


def _folded_number(node: fx.Node, val: Any) -> bool:
    """Whether ``node`` is Python arithmetic on constants alone giving a float (``1 / (h * w)``
    once the sizes are constants): the float eager computes, the same on every call."""
    return (isinstance(val, float) and node.op == "call_function" and node.target in _ARITHMETIC
            and not node.all_input_nodes)


# --------------------------------------------------------------------------- modules

def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _conv_padding(mod: nn.Conv2d) -> tuple[int, int] | None:
    if not isinstance(mod.padding, str):
        return _pair(mod.padding)
    if mod.padding == "valid":
        return (0, 0)
    pads = []
    for k, d in zip(mod.kernel_size, mod.dilation):  # 'same' with stride 1
        total = d * (k - 1)
        if total % 2:
            return None
        pads.append(total // 2)
    return tuple(pads)


def _string_padding(padding: str, weight: tuple[int, ...] | None,
                    dilation: Any) -> tuple[int, int] | None:
    """``"valid"`` or ``"same"`` as the padding of each side (``None``: "same" with an even
    extent, which pads the sides unequally)."""
    if padding == "valid":
        return (0, 0)
    if padding != "same" or weight is None or len(weight) != 4:
        return None
    pads = []
    for k, d in zip(weight[2:], _pair(dilation)):
        total = d * (k - 1)
        if total % 2:
            return None
        pads.append(total // 2)
    return tuple(pads)


def _module_to_function(gm: fx.GraphModule, node: fx.Node) -> None:
    if writes_in_place(node):  # a graph functionalize kept as it is: the write stays
        return  # (functionalize swaps the modules of the graphs it rewrites)
    mod = gm.get_submodule(node.target)
    g = gm.graph
    x = node.args[0] if node.args else None
    kind = type(mod)
    with g.inserting_before(node):
        if kind is nn.Conv2d:
            padding = _conv_padding(mod)
            if mod.padding_mode != "zeros" or padding is None:
                return
            w = conv_weight(gm, node.target, mod)
            if w is None:
                return
            b = attribute(g, f"{node.target}.bias") if mod.bias is not None else None
            _replace(gm, node, torch.conv2d,
                     (x, w, b, _pair(mod.stride), padding, _pair(mod.dilation), mod.groups))
        elif kind is nn.ReLU:
            _replace(gm, node, torch.relu, (x,))
        elif kind is nn.ReLU6:
            _replace(gm, node, torch.clamp, (x, 0.0, 6.0))
        elif kind is nn.Hardtanh:
            _replace(gm, node, torch.clamp, (x, float(mod.min_val), float(mod.max_val)))
        elif kind is nn.Sigmoid:
            _replace(gm, node, torch.sigmoid, (x,))
        elif kind is nn.Hardsigmoid:
            _replace(gm, node, F.hardsigmoid, (x,))
        elif kind is nn.Tanh:
            _replace(gm, node, torch.tanh, (x,))
        elif kind is nn.SiLU:
            _replace(gm, node, F.silu, (x,))
        elif kind is nn.Hardswish:
            _replace(gm, node, F.hardswish, (x,))
        elif kind is nn.Identity:
            node.replace_all_uses_with(x)
            g.erase_node(node)
        elif kind is nn.BatchNorm2d:
            def attr(name):
                return attribute(g, f"{node.target}.{name}") if getattr(mod, name) is not None else None
            training = mod.training or mod.running_mean is None
            if mod.training and mod.track_running_stats:
                if mod.momentum is None:  # its factor is read from a tensor as a float
                    _replace(gm, node, cumulative_batch_norm,
                             (x, attr("running_mean"), attr("running_var"), attr("weight"),
                              attr("bias"), attr("num_batches_tracked"), mod.eps))
                return  # the module also updates num_batches_tracked: leave it to PyTorch
            momentum = 0.0 if mod.momentum is None else mod.momentum
            # in training without tracking, statistics kept anyway are neither used nor updated
            stats = not mod.training or mod.track_running_stats
            _replace(gm, node, F.batch_norm,
                     (x, attr("running_mean") if stats else None,
                      attr("running_var") if stats else None, attr("weight"), attr("bias"),
                      training, momentum, mod.eps))
        elif kind is nn.AvgPool2d:
            _replace(gm, node, F.avg_pool2d,
                     (x, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode,
                      mod.count_include_pad, mod.divisor_override))
        elif kind is nn.AdaptiveAvgPool2d:
            _replace(gm, node, F.adaptive_avg_pool2d, (x, mod.output_size))
        elif is_weight_norm(mod) and len(node.args) == 2 and not node.kwargs:  # (g, v)
            _replace(gm, node, torch._weight_norm, (node.args[1], node.args[0], mod.dim))


# --------------------------------------------------------------------------- calls

def _bind(node: fx.Node, names: list[str], defaults: dict[str, Any]) -> dict[str, Any] | None:
    """Positional + keyword arguments of ``node`` by name; ``None`` if unknown keywords appear."""
    bound = dict(defaults)
    for name, value in zip(names, node.args):
        bound[name] = value
    for name, value in node.kwargs.items():
        if name not in names:
            return None
        bound[name] = value
    return bound


def _is_hw(dims: Any, rank: int | None) -> bool:
    if rank != 4 or dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % 4 for d in dims) == HW_DIMS


def _canonicalize_call(gm: fx.GraphModule, node: fx.Node, differentiable: bool) -> None:
    if writes_in_place(node):  # one functionalize kept (its graph's fusion is off): it stays,
        return  # its write included (F.relu(y, inplace=True) made relu(y) left y unrectified)
    g = gm.graph
    target = node.target
    if node.op == "call_method":
        target = _METHODS.get(node.target, node.target)
    elif target in _FUNCS:
        target = _FUNCS[target]

    if target in (torch.conv2d, F.conv2d):
        a = _bind(node, ["input", "weight", "bias", "stride", "padding", "dilation", "groups"],
                  {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1})
        if a is not None and isinstance(a["padding"], str):
            a["padding"] = _string_padding(a["padding"], tensor_shape(a["weight"]), a["dilation"])
        if a is None or a["padding"] is None or tensor_shape(node) is None:
            node.target = F.conv2d  # not the canonical convolution: no region takes it
            node.op = "call_function"
            return
        with g.inserting_before(node):
            conv = g.call_function(CONV, (a["input"], a["weight"], None, _pair(a["stride"]),
                                          _pair(a["padding"]), _pair(a["dilation"]), a["groups"]))
            conv.meta.update(node.meta)
            out = conv
            if a["bias"] is not None:  # per channel: [1, K, 1, 1], or [K, 1, 1] unbatched
                rank = len(tensor_shape(node))
                bias = g.call_function(torch.reshape, (a["bias"], (1, -1, 1, 1)[4 - rank:]))
                out = g.call_function(torch.add, (conv, bias))
                out.meta.update(node.meta)  # the conv's value: later rewrites read its shape
        node.replace_all_uses_with(out)
        g.erase_node(node)
    elif target in (torch.add, torch.sub, torch.mul, torch.div):
        canonical_binary(node, target, ssa=not gm.meta.get("fusion_off"))
    elif target in (torch.relu, torch.sigmoid, torch.tanh, F.silu):
        if len(node.args) <= 2 and set(node.kwargs) <= {"inplace"}:
            _retarget(node, target, (node.args[0],), {})
    elif target is F.relu6:
        _retarget(node, torch.clamp, (node.args[0], 0.0, 6.0), {})
    elif target is F.hardtanh:
        a = _bind(node, ["input", "min_val", "max_val", "inplace"],
                  {"min_val": -1.0, "max_val": 1.0, "inplace": False})
        if a is not None:
            _retarget(node, torch.clamp, (a["input"], a["min_val"], a["max_val"]), {})
    elif target in (torch.clamp, torch.clamp_min):
        names = ["input", "min", "max"] if target is torch.clamp else ["input", "min"]
        a = _bind(node, names, {"min": None, "max": None})
        if a is not None and not differentiable and _is_relu(node, a):  # relu: clamp_min(x, 0)
            _retarget(node, torch.relu, (a["input"],), {})
        elif a is not None:
            _retarget(node, torch.clamp, (a["input"], a["min"], a["max"]), {})
    elif target in ("mean", "sum", torch.mean, torch.sum):
        a = _bind(node, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
        if a is None or "dtype" in node.kwargs:
            return
        mean = target in ("mean", torch.mean)
        if _is_hw(a["dim"], len(tensor_shape(a["input"]) or ())):
            spatial_reduction(gm, node, a["input"], mean=mean, keepdim=a["keepdim"])
        elif tensor_shape(node) is not None and (x := flattened_hw(
                a["input"], a["dim"], ssa=not gm.meta.get("fusion_off"))) is not None:
            spatial_reduction(gm, node, x, mean=mean, keepdim=False, shape=tensor_shape(node))
    elif target is torch._weight_norm and len(node.args) == 3 and not node.kwargs:
        _weight_norm_formula(gm, node)
    elif target is F.adaptive_avg_pool2d:
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        if size in (1, (1, 1), [1, 1]) and len(tensor_shape(node.args[0]) or ()) == 4:
            spatial_reduction(gm, node, node.args[0], mean=True, keepdim=True)
    elif target is F.avg_pool2d and (x := whole_window_pool(node)) is not None:
        spatial_reduction(gm, node, x, mean=True, keepdim=True)


def _is_relu(node: fx.Node, a: dict[str, Any]) -> bool:
    """Whether the clamp ``node`` (bound arguments ``a``) is ``clamp(x, min=0)`` of a floating
    ``x`` into its own dtype: ``torch.relu(x)``, which ATen computes as ``clamp_min(x, 0)`` (its
    forward; not ``min=-0.0``, which keeps the sign of a negative input's zero)."""
    low, val, x = a["min"], node.meta.get("val"), a["input"]
    xval = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (a["max"] is None and type(low) in (int, float) and low == 0
            and math.copysign(1.0, low) > 0
            and isinstance(val, torch.Tensor) and isinstance(xval, torch.Tensor)
            and val.is_floating_point() and val.dtype == xval.dtype)


def _weight_norm_formula(gm: fx.GraphModule, node: fx.Node) -> None:
    """``torch._weight_norm(v, g, dim)`` -> ``v * (g / torch.norm_except_dim(v, 2, dim))``, the
    formula ATen's ``_weight_norm`` computes where it does not call its fused CUDA kernel
    (``aten/src/ATen/native/WeightNorm.cpp``). On CUDA fp16 the fused kernel's backward takes
    fp32 norms, and the training graph Inductor compiles hands it fp16 ones (torch 2.11: "expected
    scalar type Float but found Half"; docs/decisions.md, "Weight norm as its formula")."""
    v, g_, dim = node.args
    g = gm.graph
    with g.inserting_before(node):
        norm = g.call_function(torch.norm_except_dim, (v, 2, dim))
        out = g.call_function(torch.mul, (v, g.call_function(torch.div, (g_, norm))))
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    g.erase_node(node)


# --------------------------------------------------------------------------- helpers

def _retarget(node: fx.Node, target: Callable, args: tuple | None = None,
              kwargs: dict | None = None) -> None:
    node.op = "call_function"
    node.target = target
    if args is not None:
        node.args = args
    if kwargs is not None:
        node.kwargs = kwargs


def _replace(gm: fx.GraphModule, node: fx.Node, target: Callable | str, args: tuple,
             kwargs: dict | None = None, op: str = "call_function") -> fx.Node:
    """Insert ``target(*args, **kwargs)`` before ``node``, move ``node``'s users to it, erase
    ``node``."""
    g = gm.graph
    with g.inserting_before(node):
        new = g.create_node(op, target, tuple(args), dict(kwargs or {}))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new
