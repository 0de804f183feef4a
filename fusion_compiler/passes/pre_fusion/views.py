"""canonical_views: the shape-only views of a graph written one way.

``g.unsqueeze(-1).unsqueeze(-1)``, ``g.view(n, c, 1, 1)``, ``g[:, :, None, None]`` and
``g.reshape(n, c, 1, 1)`` give the same tensor; the passes that recognize a pattern through a
view (the SE gate's broadcast, ``passes.post_lowering.se_gate``) should not depend on which one a
network's author wrote. This pass makes every ``unsqueeze`` and ``squeeze`` (method or function)
a ``torch.reshape`` to the shape it produced, and a ``torch.reshape`` of a ``torch.reshape`` (or
of a ``view``) with no other reader one ``torch.reshape`` of the first input. Each is the same
view of the same memory: only size-1 dimensions are added or dropped, and reshaping a reshape
gives what the second alone gives; shapes are static in a compiled graph (specialized to its
inputs).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...ir.ops import is_call

__all__ = ["canonical_views"]

_SIZE_ONE_METHODS = ("unsqueeze", "squeeze")
_SIZE_ONE_FUNCTIONS = (torch.unsqueeze, torch.squeeze)


def canonical_views(gm: fx.GraphModule) -> list[str]:
    """Rewrite ``gm``'s views in place (see the module doc); returns the names of the nodes
    rewritten."""
    g = gm.graph
    done: list[str] = []
    for node in list(g.nodes):
        size_one = (node.op == "call_method" and node.target in _SIZE_ONE_METHODS) or is_call(
            node, *_SIZE_ONE_FUNCTIONS)
        val = node.meta.get("val")
        if size_one and isinstance(val, torch.Tensor) and isinstance(node.args[0], fx.Node):
            with g.inserting_before(node):
                new = g.call_function(torch.reshape, (node.args[0], tuple(val.shape)))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            g.erase_node(node)
            done.append(node.name)
    for node in list(g.nodes):
        inner = node.args[0] if is_call(node, torch.reshape) else None
        if (isinstance(inner, fx.Node) and len(inner.users) == 1
                and (is_call(inner, torch.reshape) or (
                    inner.op == "call_method" and inner.target == "view"))
                and isinstance(inner.args[0], fx.Node)):
            node.args = (inner.args[0], *node.args[1:])
            g.erase_node(inner)
            done.append(inner.name)
    return done
