"""normalize: bring a captured graph to the canonical, SSA form of :mod:`fusion_compiler.ir.ops`.

Rewrites, in this order:

1. **functionalize** -- every in-place op (``relu_``, ``add_``, ``+=``, ``F.relu(inplace=True)``,
   ``nn.ReLU(inplace=True)``) becomes its out-of-place twin, and every later reader of the mutated
   value reads the new node instead. Afterwards each value is written once (SSA).
2. **specialize shapes** -- shape arithmetic (``x.shape``, ``x.size(1)``, ``H // 4``) and integer
   inputs (the ``SymInt`` sizes Dynamo passes to a graph with a dynamic batch) become
   constants: a compiled graph is specialized on its input shapes and integer values anyway.
3. **modules to functions** -- ``nn.Conv2d``,
   ``nn.ReLU``/``ReLU6``/``Hardtanh``/``Sigmoid``/``Tanh``, ``nn.BatchNorm2d``, ``nn.AvgPool2d``,
   ``nn.AdaptiveAvgPool2d(1)`` and ``nn.Identity`` become function calls; other modules stay as
   ``call_module``.
4. **canonical calls** -- ``conv2d(x, w, b)`` -> ``conv2d(x, w, None)`` +
   ``add(., b.reshape(1,K,1,1))``; operators and methods (``x + y``, ``x.mul(y)``) ->
   ``torch.add``/``torch.mul``/...; ``relu6``/``hardtanh``/``clamp`` -> ``torch.clamp``;
   ``mean``/``adaptive_avg_pool2d(., 1)`` over H, W ->
   ``sum(x, [2, 3], keepdim=True) * (1 / (H*W))``.

Nodes it cannot bring to canonical form are left as they are (they will run in PyTorch).
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.node import map_aggregate

from ...ir.errors import FusionError
from ...ir.ops import CONV, HW_DIMS

__all__ = ["normalize", "inplace_target"]

# in-place target -> out-of-place canonical target (call_function and call_method spellings)
_INPLACE_FUNCS = {operator.iadd: torch.add, operator.isub: torch.sub, operator.imul: torch.mul,
                  operator.itruediv: torch.div, torch.relu_: torch.relu, F.relu_: torch.relu}
# functions whose positional argument at this index is ``inplace``
_INPLACE_POSITION = {F.relu: 1, F.relu6: 1, F.hardtanh: 3, F.elu: 2, F.leaky_relu: 2, F.silu: 1}
_METHODS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
            "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "clamp": torch.clamp,
            "clip": torch.clamp}
_FUNCS = {operator.add: torch.add, operator.sub: torch.sub, operator.mul: torch.mul,
          operator.truediv: torch.div, torch.add: torch.add, torch.sub: torch.sub,
          torch.mul: torch.mul, torch.div: torch.div, torch.relu: torch.relu, F.relu: torch.relu,
          torch.sigmoid: torch.sigmoid, F.sigmoid: torch.sigmoid, torch.tanh: torch.tanh,
          F.tanh: torch.tanh, torch.clamp: torch.clamp, torch.clip: torch.clamp, F.silu: F.silu}


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``gm`` in place into canonical SSA form (see the module docstring) and return it.

    Needs ``node.meta["val"]`` from :func:`fusion_compiler.capture.propagate_shapes`.

    Raises:
        FusionError: an in-place op mutates a graph input or a parameter (the compiled module
            could not reproduce that side effect).
    """
    _functionalize(gm)
    _specialize_shapes(gm)
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            _module_to_function(gm, node)
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method"):
            _canonicalize_call(gm, node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- functionalize

def inplace_target(gm: fx.GraphModule, node: fx.Node) -> Callable | str | None:
    """The out-of-place target for an in-place ``node`` (a function, a method name or the module
    path), or ``None`` if ``node`` does not write into its first argument."""
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCS:
            return _INPLACE_FUNCS[node.target]
        position = _INPLACE_POSITION.get(node.target)
        if node.kwargs.get("inplace") is True or (
                position is not None and len(node.args) > position and node.args[position] is True):
            return node.target
    elif node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.target[:-1]
    elif node.op == "call_module":
        if getattr(gm.get_submodule(node.target), "inplace", False) is True:
            return node.target
    return None


def _functionalize(gm: fx.GraphModule) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        twin = inplace_target(gm, node)
        if twin is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        if mutated.op in ("placeholder", "get_attr"):
            raise FusionError(
                f"in-place op {node.target} mutates {mutated.op} '{mutated.target}'; the compiled "
                "module cannot reproduce that side effect: write it out of place", node.name)
        if node.op == "call_module":
            # Run a private out-of-place copy: the user's module is shared and must not change.
            twin_mod = copy.copy(gm.get_submodule(node.target))
            twin_mod.inplace = False
            name = node.target.replace(".", "_") + "_out_of_place"
            gm.add_submodule(name, twin_mod)
            node.target = name
        else:
            node.target = twin
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
            position = _INPLACE_POSITION.get(twin)
            if position is not None and len(node.args) > position:
                node.args = node.args[:position] + (False,) + node.args[position + 1:]
        # Readers of the mutated value that come after the in-place op read its result instead.
        for user in list(mutated.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(mutated, node)


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
        if isinstance(val, bool) or not is_static(val):
            continue
        const = tuple(val) if isinstance(val, torch.Size) else val
        for user in list(node.users):
            user.args = map_aggregate(user.args, lambda a: const if a is node else a)
            user.kwargs = map_aggregate(user.kwargs, lambda a: const if a is node else a)
    gm.graph.eliminate_dead_code()


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


def _module_to_function(gm: fx.GraphModule, node: fx.Node) -> None:
    mod = gm.get_submodule(node.target)
    g = gm.graph
    x = node.args[0] if node.args else None
    kind = type(mod)
    with g.inserting_before(node):
        if kind is nn.Conv2d:
            padding = _conv_padding(mod)
            if mod.padding_mode != "zeros" or padding is None:
                return
            w = g.get_attr(f"{node.target}.weight")
            b = g.get_attr(f"{node.target}.bias") if mod.bias is not None else None
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
        elif kind is nn.Tanh:
            _replace(gm, node, torch.tanh, (x,))
        elif kind is nn.SiLU:
            _replace(gm, node, F.silu, (x,))
        elif kind is nn.Identity:
            node.replace_all_uses_with(x)
            g.erase_node(node)
        elif kind is nn.BatchNorm2d:
            def attr(name):
                return g.get_attr(f"{node.target}.{name}") if getattr(mod, name) is not None else None
            training = mod.training or mod.running_mean is None
            if mod.training and mod.track_running_stats:
                return  # the module also updates num_batches_tracked: leave it to PyTorch
            momentum = 0.0 if mod.momentum is None else mod.momentum
            _replace(gm, node, F.batch_norm,
                     (x, attr("running_mean"), attr("running_var"), attr("weight"), attr("bias"),
                      training, momentum, mod.eps))
        elif kind is nn.AvgPool2d:
            _replace(gm, node, F.avg_pool2d,
                     (x, mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode,
                      mod.count_include_pad, mod.divisor_override))
        elif kind is nn.AdaptiveAvgPool2d:
            _replace(gm, node, F.adaptive_avg_pool2d, (x, mod.output_size))


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


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_hw(dims: Any, rank: int | None) -> bool:
    if rank != 4 or dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % 4 for d in dims) == HW_DIMS


def _canonicalize_call(gm: fx.GraphModule, node: fx.Node) -> None:
    g = gm.graph
    target = node.target
    if node.op == "call_method":
        target = _METHODS.get(node.target, node.target)
    elif target in _FUNCS:
        target = _FUNCS[target]

    if target in (torch.conv2d, F.conv2d):
        a = _bind(node, ["input", "weight", "bias", "stride", "padding", "dilation", "groups"],
                  {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1})
        if a is None or isinstance(a["padding"], str) or _shape(node) is None:
            return
        with g.inserting_before(node):
            conv = g.call_function(CONV, (a["input"], a["weight"], None, _pair(a["stride"]),
                                          _pair(a["padding"]), _pair(a["dilation"]), a["groups"]))
            conv.meta.update(node.meta)
            out = conv
            if a["bias"] is not None:  # per channel: [1, K, 1, 1], or [K, 1, 1] unbatched
                rank = len(_shape(node))
                bias = g.call_function(torch.reshape, (a["bias"], (1, -1, 1, 1)[4 - rank:]))
                out = g.call_function(torch.add, (conv, bias))
                out.meta.update(node.meta)  # the conv's value: later rewrites read its shape
        node.replace_all_uses_with(out)
        g.erase_node(node)
    elif target in (torch.add, torch.sub, torch.mul, torch.div):
        if len(node.args) == 2 and not node.kwargs:
            _retarget(node, target)
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
    elif target is torch.clamp:
        a = _bind(node, ["input", "min", "max"], {"min": None, "max": None})
        if a is not None:
            _retarget(node, torch.clamp, (a["input"], a["min"], a["max"]), {})
    elif target in ("mean", "sum", torch.mean, torch.sum):
        a = _bind(node, ["input", "dim", "keepdim"], {"dim": None, "keepdim": False})
        if a is None or "dtype" in node.kwargs or not _is_hw(a["dim"], len(_shape(a["input"]) or ())):
            return
        _hw_reduction(gm, node, a["input"], mean=target in ("mean", torch.mean), keepdim=a["keepdim"])
    elif target is F.adaptive_avg_pool2d:
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        if size in (1, (1, 1), [1, 1]) and len(_shape(node.args[0]) or ()) == 4:
            _hw_reduction(gm, node, node.args[0], mean=True, keepdim=True)


def _hw_reduction(gm: fx.GraphModule, node: fx.Node, x: fx.Node, mean: bool, keepdim: bool) -> None:
    """``sum``/``mean`` over H, W -> ``sum(x, [2, 3], keepdim=True)`` (``* 1/(H*W)``)
    (``reshape``)."""
    n, c, h, w = _shape(x)
    g = gm.graph
    with g.inserting_before(node):
        out = g.call_function(torch.sum, (x, list(HW_DIMS)), {"keepdim": True})
        if mean:
            out = g.call_function(torch.mul, (out, 1.0 / (h * w)))
        if not keepdim:
            out = g.call_function(torch.reshape, (out, (n, c)))
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
