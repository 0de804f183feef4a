"""functionalize: in-place ops become out-of-place (SSA), with the writes eager leaves behind
reproduced.

Every in-place op (``relu_``, ``add_``, ``+=``, ``F.relu(inplace=True)``, ``nn.ReLU(inplace=True)``)
becomes its out-of-place twin and every later reader of the written value reads the new node. A
graph input or module buffer written in place gets its last value copied back at the end of the
graph (:func:`~fusion_compiler.ir.ops.write_back`): the caller sees its tensor, the module its
buffer (batch norm's ``num_batches_tracked``, a counter), updated as eager leaves them. A write
whose memory is read later through another value (the base of a view written in place, a view
of a value written in place, an input or buffer written through a view) cannot be made out of
place without losing that sharing: the graph is then left as it is, every op of it run by
PyTorch, and :func:`functionalize` says why. A write into a view that nothing else reads later
(an in-place dropout after a ``flatten``) is rewritten like any other.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from ...ir.aliasing import (alias_source, fresh, inplace_target, may_be_view, view_chain,
                             written_attribute, written_source)
from ...ir.ops import INPLACE_POSITION, foreach_inplace, write_back

__all__ = ["functionalize", "inplace_target"]


def functionalize(gm: fx.GraphModule) -> str:
    """Rewrite ``gm``'s in-place ops (in place; see the module docstring). Returns ``""``, or why
    the graph was left as it is: an in-place op writes into memory that another value shares."""
    unrolled = _unroll_foreach(gm)
    if unrolled:
        return unrolled
    shared = _shared_write(gm)
    if shared:
        return shared
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    written: dict[fx.Node, fx.Node] = {}  # graph input or buffer -> its last value
    root_of: dict[fx.Node, fx.Node] = {}  # each value written into one -> the input or buffer
    for node in list(gm.graph.nodes):
        twin = inplace_target(gm, node)
        if twin is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        root = written_root(mutated, written)
        node.meta.pop("shares", None)  # (the in-place op's: out of place it shares nothing)
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
            position = INPLACE_POSITION.get(twin)
            if position is not None and len(node.args) > position:
                node.args = node.args[:position] + (False,) + node.args[position + 1:]
        # Readers of the mutated value that come after the in-place op read its result instead.
        for user in list(mutated.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(mutated, node)
        if root.op in ("placeholder", "get_attr"):
            written[root], root_of[node] = node, root
    output = gm.graph.find_nodes(op="output")[0]
    for root, value in written.items():
        with gm.graph.inserting_before(output):
            gm.graph.call_function(write_back, (root, value))
    for value, root in root_of.items():  # returned: the caller's tensor (the buffer), as eager
        output.replace_input_with(value, root)  # returns it (its last value written back)
    return ""


def _unroll_foreach(gm: fx.GraphModule) -> str:
    """Each in-place multi-tensor op (``torch._foreach_mul_(grads, c)``) becomes one in-place
    method call per tensor of its list (``g.mul_(c)``; a list argument gives each call its own
    element, any other is passed to every call), which the rewrite below makes out of place.
    Returns why it could not (a ``_foreach`` op without a per-tensor method, or lists of
    another length): the graph is then left as it is."""
    for node in list(gm.graph.nodes):
        if not foreach_inplace(node):
            continue
        method = node.target.__name__[len("_foreach_"):]
        kept = f"in-place multi-tensor op {node.target.__name__} ({node.name}) kept as it is"
        targets = node.args[0] if node.args else None
        if node.users or not isinstance(targets, (list, tuple)) or not hasattr(
                torch.Tensor, method) or any(isinstance(a, (list, tuple)) and len(a) != len(
                    targets) for a in (*node.args[1:], *node.kwargs.values())):
            return kept
        args, kwargs = node.args[1:], dict(node.kwargs)
        if method in ("addcmul_", "addcdiv_") and len(args) > 2:  # its scale is keyword-only
            if isinstance(args[2], fx.Node):  # one tensor of scales
                return kept
            args, kwargs = args[:2], {**kwargs, "value": args[2]}
        with gm.graph.inserting_before(node):
            for i, t in enumerate(targets):
                gm.graph.call_method(method, (t, *(_pick(a, i) for a in args)),
                                     {k: _pick(v, i) for k, v in kwargs.items()})
        gm.graph.erase_node(node)
    return ""


def _pick(a: object, i: int) -> object:
    return a[i] if isinstance(a, (list, tuple)) else a


def written_root(node: fx.Node, written: dict[fx.Node, fx.Node]) -> fx.Node:
    """The graph input or buffer whose value ``node`` is, after in-place ops rewritten so far
    (``written``: root -> its latest value), else ``node``."""
    for root, value in written.items():
        if value is node:
            return root
    return node


def _shared_write(gm: fx.GraphModule) -> str:
    """Why ``gm``'s in-place ops cannot be made out of place (``""``: they can): the first that
    writes into a view, or into a value of which a view taken before it is read after it, or
    into a parameter that requires gradients (or a view of one)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.setitem:
            return f"an item assignment ({node.name}) writes into a tensor in place"
        twin = inplace_target(gm, node)
        if twin is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        if node.op == "call_method" and not hasattr(torch.Tensor, twin):
            return f"in-place op {node.target} ({node.name}) has no out-of-place twin"
        path, held = written_attribute(gm, node) or (None, None)
        if isinstance(held, torch.nn.Parameter) and held.requires_grad:
            # (forward's ``with torch.no_grad(): self.w.clamp_(-1, 1)``: out of place, the
            # readers after it would read a value without gradient, and the write back fail)
            return (f"in-place op {node.target} ({node.name}) writes into parameter "
                    f"'{path}', which its readers after it must see as the parameter")
        if _read_through_another_alias(gm, node, order):
            return (f"in-place op {node.target} ({node.name}) writes into memory that another "
                    "value of the graph shares (a view)")
    return ""


def _read_through_another_alias(gm: fx.GraphModule, node: fx.Node,
                                order: dict[fx.Node, int]) -> bool:
    """Whether the memory the in-place ``node`` writes may be seen after it through another
    value than the one it writes. The rewrite makes every later reader of the written value
    read the new one, and follows chains of in-place ops (``x.sub_(m).div_(s)``); it cannot
    follow memory shared through a view. So: a view of the written value (or of a value it is
    a view of) taken before ``node`` and read after it; a write into a view whose base may share
    memory with anything else (an input, a buffer, an op not known to make new memory); or that
    base, or another view of it, read after ``node``. A write into a view of new memory that
    nothing else reads later (an in-place dropout after a ``flatten`` of a pooling) is made out
    of place like any other."""
    written = node.args[0]

    def same_value(start: fx.Node) -> set[fx.Node]:  # linked by in-place ops, no view between
        found, stack = set(), [start]
        while stack:
            value = stack.pop()
            if value in found:
                continue
            found.add(value)
            if written_source(gm, value) is not None:
                stack.append(written_source(gm, value))
            stack += [u for u in value.users
                      if u is not node and written_source(gm, u) is value]
        return found

    written_value = same_value(written)
    chain = view_chain(gm, written)
    base, through_view = chain[-1], any(map(may_be_view, chain[:-1]))
    if through_view and (base.op in ("placeholder", "get_attr") or not fresh(gm, base)):
        return True
    aliases, stack = set(), [base]
    while stack:
        value = stack.pop()
        if value not in aliases:
            aliases.add(value)
            stack += [u for u in value.users if u is not node and order[u] < order[node]
                      and (written_source(gm, u) is value
                           or may_be_view(u) and alias_source(u) is value)]
    return any(order[r] > order[node] for a in aliases - written_value
               for r in a.users if r is not node)
