"""cse: common-subexpression elimination of the canonical graph.

Two nodes that compute the same pure function of the same values become one: the second's users
read the first. Equivalent spellings of a network then give one graph; in SE-ResNet9-Fixup as its
authors wrote it, a block adds its scalar bias to the block input once for the main path and once
more for the downsample, and only with one ``add`` do the two convolutions read the same image,
which horizontal fusion needs (``passes.pre_fusion.horizontal``).

What counts as the same: the same ``get_attr`` target (two reads of one parameter), or the same pure
call (target and arguments, the arguments' nodes already merged, constants compared by type and
value) in the same gradient zone (``meta["grad_zone"]``: a value computed under ``no_grad`` is not
one computed with gradients) and the same autocast zone (between the same
``_enter_autocast``/``_exit_autocast`` calls a Dynamo graph holds: a matmul under autocast is not
one outside it). A value the graph returns is not merged into another: eager returns two tensors,
and a user who writes into one must not change the other. Pure calls are this package's canonical
ops and the view and shape ops (an allowlist: a random op, an op that writes a buffer such as a
train-mode batch norm, or a module call is never merged), and never a call whose value depends on a
buffer: a module call may update a buffer between two reads (a train-mode batch norm its running
statistics), and the two reads are then different values of one tensor. ``torch.fx``'s own
``CSEPass`` does not fit here: it copies ``get_attr`` nodes without merging them (so the two bias
adds above stay different) and hashes ``call_module`` nodes as if every module were pure.
"""

from __future__ import annotations

import operator
from typing import Any, Hashable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import BINARY, CONV, UNARY, mark_grad_zones

__all__ = ["eliminate_common_subexpressions", "PURE_FUNCTIONS", "PURE_METHODS"]

_AUTOCAST = ("_enter_autocast", "_exit_autocast")
"""Names of the calls that start and end an autocast region in a Dynamo graph."""

PURE_FUNCTIONS = frozenset({
    *BINARY, *UNARY, CONV, F.conv2d, torch.sum, torch.mean, torch.narrow, torch.cat,
    torch.reshape, torch.flatten, torch.permute, torch.transpose, torch.unsqueeze,
    torch.squeeze, F.linear, F.avg_pool2d, F.adaptive_avg_pool2d, F.max_pool2d, F.silu,
    F.hardsigmoid, F.hardswish, F.gelu, torch.neg, torch.rsqrt, torch.sqrt, torch.exp,
    operator.getitem, getattr})
"""The ``call_function`` targets merged: functions of their arguments alone, with no side
effect and no random number."""
PURE_METHODS = frozenset({
    "view", "reshape", "flatten", "permute", "transpose", "unsqueeze", "squeeze", "contiguous",
    "size", "dim", "expand", "narrow", "float", "half", "to", "mean", "sum", "t"})
"""The ``call_method`` names merged (on the same tensor with the same arguments)."""


def eliminate_common_subexpressions(gm: fx.GraphModule) -> int:
    """Merge the repeated reads and pure calls of ``gm`` (see the module doc), in place; returns
    how many nodes went. A graph that keeps in-place ops (``gm.meta["fusion_off"]``) is left
    alone: a value read twice there may have been written between the reads."""
    if gm.meta.get("fusion_off"):
        return 0
    mark_grad_zones(gm.graph)
    seen: dict[Hashable, fx.Node] = {}
    stateful: set[fx.Node] = set()  # values that depend on a buffer
    merged = autocast_zone = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _AUTOCAST:
            autocast_zone += 1
        if node.op == "get_attr" and _is_buffer(gm, node.target) or any(
                a in stateful for a in node.all_input_nodes):
            stateful.add(node)
        key = _key(node)
        if key is None or node in stateful and node.op != "get_attr" or any(
                user.op == "output" for user in node.users):
            continue
        key = (key, autocast_zone)
        twin = seen.setdefault(key, node)
        if twin is node:
            continue
        node.replace_all_uses_with(twin)
        gm.graph.erase_node(node)
        merged += 1
    return merged


def _is_buffer(gm: fx.GraphModule, target: str) -> bool:
    """Whether ``get_attr`` ``target`` is a tensor other than a parameter (state a module call
    may write)."""
    try:
        value = operator.attrgetter(target)(gm)
    except AttributeError:
        return True
    return isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)


def _key(node: fx.Node) -> Hashable | None:
    """What ``node`` computes, as a dictionary key, or ``None`` when it is not to be merged."""
    if node.op == "get_attr":
        return ("get_attr", node.target)
    if node.op == "call_function":
        if node.target not in PURE_FUNCTIONS:
            return None
    elif node.op != "call_method" or node.target not in PURE_METHODS:
        return None
    try:
        args = _frozen(node.args), _frozen(node.kwargs)
        key = (node.op, node.target, args, node.meta.get("grad_zone"))
        hash(key)
    except TypeError:  # an argument of no value identity (a tensor constant, a list of such)
        return None
    return key


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable that tells ``1``, ``1.0`` and ``True`` apart (nodes by identity)."""
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", _frozen(value.start), _frozen(value.stop), _frozen(value.step))
    if isinstance(value, float):
        return ("float", repr(value))  # -0.0 and 0.0 apart; nan equal to itself
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor constant")
    return (type(value).__name__, value)
