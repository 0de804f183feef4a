"""canonical_views: the size-one views of a graph written one way.

``g.unsqueeze(-1).unsqueeze(-1)``, ``g.view(n, c, 1, 1)``, ``g[:, :, None, None]`` and
``g.reshape(n, c, 1, 1)`` give the same tensor; the passes that recognize a pattern through such a
view (the SE gate's broadcast, ``passes.post_lowering.se_gate``) should not depend on which one a
network's author wrote. This pass makes every ``unsqueeze`` and ``squeeze`` (method or function),
and every indexing by ``None``, ``:`` and ``...`` alone (``g[..., None, None]``), a
``torch.reshape`` to the shape it produced, and folds a ``torch.reshape`` of a ``torch.reshape``
(or of a shape-only ``view``) with no other reader into one ``torch.reshape`` of the first input
when both only add or drop size-1 dimensions. Each is the same view of the same memory, and
shapes are static in a compiled graph (specialized to its inputs). Reshapes that move elements
between dimensions (SpaceToDepth's split, which ``passes.pre_fusion.rewrites`` matches) and views
that change the dtype are left as written; so is a graph that keeps in-place ops
(``gm.meta["fusion_off"]``), where a reshape may be a copy taken before a write.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...ir.ops import is_call

__all__ = ["canonical_views"]

_SIZE_ONE_METHODS = ("unsqueeze", "squeeze")
_SIZE_ONE_FUNCTIONS = (torch.unsqueeze, torch.squeeze)


def canonical_views(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm``'s views in place (see the module doc); returns the names of the nodes
    rewritten."""
    if gm.meta.get("fusion_off"):
        return []
    g = gm.graph
    done: list[str] = []
    for node in list(g.nodes):
        size_one = (node.op == "call_method" and node.target in _SIZE_ONE_METHODS) or is_call(
            node, *_SIZE_ONE_FUNCTIONS) or _new_axes(node)
        source, val = _source(node), node.meta.get("val")
        if size_one and source is not None and isinstance(val, torch.Tensor):
            with g.inserting_before(node):
                new = g.call_function(torch.reshape, (source, tuple(val.shape)))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            g.erase_node(node)
            done.append(node.name)
    for node in list(g.nodes):
        inner = _source(node) if is_call(node, torch.reshape) else None
        if inner is None or len(inner.users) != 1 or not _shape_only(inner):
            continue
        source = _source(inner)
        if source is not None and _size_one_apart(source, inner) and _size_one_apart(inner, node):
            node.args = (source, *node.args[1:])
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "input"}
            g.erase_node(inner)
            done.append(inner.name)
    return done


def _new_axes(node: fx.Node) -> bool:
    """Whether ``node`` indexes a tensor with ``None`` (a new size-1 axis), whole slices
    (``:``) and ``...`` alone, at least one ``None`` (``g[:, :, None, None]``,
    ``g[..., None, None]``): a view that only adds size-1 dimensions."""
    if not is_call(node, operator.getitem) or len(node.args) != 2 or node.kwargs:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return isinstance(source, torch.Tensor) and None in index and all(
        i is None or i is Ellipsis or isinstance(i, slice) and i == slice(None) for i in index)


def _source(node: fx.Node) -> fx.Node | None:
    """The tensor a view call reads (first positional argument, or ``input=``), if a node."""
    value: Any = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))
    return value if isinstance(value, fx.Node) else None


def _shape_only(node: fx.Node) -> bool:
    """Whether ``node`` is a ``torch.reshape`` or a ``view`` to a shape (not to a dtype)."""
    if is_call(node, torch.reshape):
        return True
    if node.op != "call_method" or node.target != "view":
        return False
    flat = [a for arg in node.args[1:] for a in (arg if isinstance(arg, (tuple, list)) else [arg])]
    return all(isinstance(a, int) for a in flat) and not node.kwargs


def _size_one_apart(a: fx.Node, b: fx.Node) -> bool:
    """Whether the values of ``a`` and ``b`` have one dtype and the same sizes once their size-1
    dimensions are dropped (``b`` only adds or drops such dimensions)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    return va.dtype == vb.dtype and ([d for d in va.shape if d != 1]
                                     == [d for d in vb.shape if d != 1])
