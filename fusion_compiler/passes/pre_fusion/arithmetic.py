"""Binary arithmetic written one way, part of ``normalize``'s canonical calls.

Equivalent spellings of one ``add``/``sub``/``mul``/``div`` become one node, so the passes that
match a pattern (regions' epilogues, horizontal fusion's chains, the SE kernels) see one graph.
Each rewrite gives the same value to the bit (IEEE addition and multiplication are commutative;
``a - b`` is defined as ``a + (-b)``; a multiple by ``alpha = 1`` is the value itself;
``x / 2**k`` and ``x * 2**-k`` are both the correctly rounded value of the same real number):

* ``torch.add(a, b, alpha=1)``, ``a.add(b, alpha=1)`` -> ``torch.add(a, b)``; ``alpha=-1``
  swaps ``add`` and ``sub``; any other ``alpha`` (or another keyword) is left as written;
* ``a - (-b)`` -> ``a + b``, ``a + (-b)`` and ``(-b) + a`` -> ``a - b``;
* an operand ``s.expand(...)``/``s.expand_as(y)``/``torch.broadcast_to(s, ...)`` -> ``s`` where
  broadcasting ``s`` gives the op's result shape anyway (the SE gate's ``x * s.expand_as(x)``);
* ``add``/``mul`` with the operand of the result's shape first (``bias + x`` -> ``x + bias``,
  ``2 * x`` -> ``x * 2``, ``scale * out`` -> ``out * scale``), as a region's epilogue and
  horizontal fusion's chains read them;
* ``x / c`` for a number ``c`` whose reciprocal is exact (a power of two) -> ``x * (1 / c)``;
* a number times the ``[N, C]`` reshape of an H, W sum (``x.sum((2, 3)) / (H*W)``) -> the
  reshape of that product: the form ``normalize`` gives ``x.mean((2, 3))``.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from ...ir.ops import COMMUTATIVE, is_call, is_hw_sum, tensor_shape

__all__ = ["canonical_binary"]

_NEGATIONS = (operator.neg, torch.neg)
_EXPANSIONS = ("expand", "expand_as")
_FLIPPED = {torch.add: torch.sub, torch.sub: torch.add}


def canonical_binary(node: fx.Node, target: Callable, ssa: bool = True) -> bool:
    """Rewrite ``node``, a call of ``target`` (``torch.add``, ``sub``, ``mul`` or ``div``, as
    ``normalize`` maps operators and methods to them) in its canonical form (module doc), in
    place. Its operands must be canonical already (``normalize`` visits nodes in graph order).
    In a graph that keeps in-place ops (``ssa`` false) a negation is not folded, nor a scale
    moved: a write between the two ops would tell the spellings apart. Returns ``False``
    (``node`` untouched) when it has arguments besides its two operands and ``alpha``, or an
    ``alpha`` other than 1 and -1. Reads shapes from ``meta["val"]``; an operand without one is
    kept where it is. No error is raised."""
    kwargs = dict(node.kwargs)
    alpha = kwargs.pop("alpha", 1)
    if len(node.args) != 2 or kwargs or isinstance(alpha, bool) or alpha not in (1, -1):
        return False
    if alpha == -1:
        if target not in _FLIPPED:
            return False
        target = _FLIPPED[target]
    a, b = node.args
    a = _unexpanded(a, b, node)
    b = _unexpanded(b, a, node)  # against the first as it is now: both may not broadcast away
    if ssa and target in _FLIPPED and _negated(b) is not None:  # a - (-b), a + (-b)
        target, b = _FLIPPED[target], _negated(b)
    elif ssa and target is torch.add and _negated(a) is not None:  # (-b) + a
        target, a, b = torch.sub, b, _negated(a)
    if target in COMMUTATIVE and _goes_second(a, b, node):
        a, b = b, a
    if target is torch.div and _exact_reciprocal(b):
        target, b = torch.mul, 1.0 / b
    node.op, node.target, node.args, node.kwargs = "call_function", target, (a, b), {}
    if ssa and target is torch.mul and isinstance(b, (int, float)) and not isinstance(b, bool):
        _scale_before_view(node)
    return True


def _negated(value: object) -> fx.Node | None:
    """``b`` when ``value`` is ``-b`` (``operator.neg``, ``torch.neg`` or ``b.neg()``)."""
    if not isinstance(value, fx.Node) or len(value.args) != 1 or value.kwargs:
        return None
    if is_call(value, *_NEGATIONS) or (value.op == "call_method" and value.target == "neg"):
        return value.args[0] if isinstance(value.args[0], fx.Node) else None
    return None


def _unexpanded(value: object, other: object, node: fx.Node) -> object:
    """``s`` when ``value`` broadcasts a tensor ``s`` (``expand``, ``expand_as``,
    ``broadcast_to``) and ``s`` broadcast with ``other`` gives ``node``'s shape, else
    ``value``."""
    if not isinstance(value, fx.Node) or not value.args:
        return value
    expanding = (value.op == "call_method" and value.target in _EXPANSIONS) or is_call(
        value, torch.broadcast_to)
    source = value.args[0]
    if not expanding or not isinstance(source, fx.Node):
        return value
    shapes = [tensor_shape(source), tensor_shape(node)]
    if not isinstance(other, (int, float)):
        shapes.append(tensor_shape(other))
    if None in shapes:
        return value
    try:
        broadcast = tuple(torch.broadcast_shapes(*shapes[:1], *shapes[2:]))
    except RuntimeError:
        return value
    return source if broadcast == shapes[1] else value


def _goes_second(a: object, b: object, node: fx.Node) -> bool:
    """Whether the commutative ``a op b`` is canonical as ``b op a``: ``a`` a number and ``b``
    a node, or ``b`` of the result's shape and ``a`` not."""
    if isinstance(a, (int, float)):
        return isinstance(b, fx.Node)
    out, sa, sb = tensor_shape(node), tensor_shape(a), tensor_shape(b)
    return out is not None and sa is not None and sb == out and sa != out


def _exact_reciprocal(value: object) -> bool:
    """Whether ``value`` is a Python number ``+-2**k`` whose reciprocal every floating dtype
    holds exactly (``2**-24 <= |1 / value| <= 2**15``: fp16's smallest subnormal to a power of
    two below its largest finite value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0 \
            or not math.isfinite(value):
        return False
    mantissa, exponent = math.frexp(abs(value))  # |value| = mantissa * 2**exponent
    return mantissa == 0.5 and -14 <= exponent <= 25


def _scale_before_view(node: fx.Node) -> None:
    """``mul(reshape(s, (N, C)), c)`` -> ``reshape(mul(s, c), (N, C))`` when ``s`` is an H, W
    sum that only the reshape reads, and the reshape only ``node``: the form ``normalize``
    writes a spatial mean in (the scale is pointwise, so it commutes with the view)."""
    view = node.args[0]
    if not is_call(view, torch.reshape) or len(view.users) != 1 or not is_hw_sum(view.args[0]) \
            or len(view.args[0].users) != 1:
        return
    total = view.args[0]
    graph = node.graph
    with graph.inserting_before(view):
        scaled = graph.call_function(torch.mul, (total, node.args[1]))
    view.replace_input_with(total, scaled)
    node.replace_all_uses_with(view)
    graph.erase_node(node)
