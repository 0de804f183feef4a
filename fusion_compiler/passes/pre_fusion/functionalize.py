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
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import INPLACE_POSITION, foreach_inplace, inplace_flag, write_back

__all__ = ["functionalize", "inplace_target"]

# in-place target -> out-of-place canonical target (call_function and call_method spellings)
_INPLACE_FUNCS = {operator.iadd: torch.add, operator.isub: torch.sub, operator.imul: torch.mul,
                  operator.itruediv: torch.div, torch.relu_: torch.relu, F.relu_: torch.relu}
_AUGMENTED = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def inplace_target(gm: fx.GraphModule, node: fx.Node) -> Callable | str | None:
    """The out-of-place target for an in-place ``node`` (a function, a method name or the module
    path), or ``None`` if ``node`` does not write into its first argument."""
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCS:  # x += y on a number (shape arithmetic) writes nothing
            value = node.args[0].meta.get("val") if node.args and isinstance(
                node.args[0], fx.Node) else None
            numeric = value is not None and not isinstance(value, torch.Tensor)
            return None if numeric and node.target in _AUGMENTED else _INPLACE_FUNCS[node.target]
        if inplace_flag(node):
            return node.target
    elif node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.target[:-1]
    elif node.op == "call_module":
        if getattr(gm.get_submodule(node.target), "inplace", False) is True:
            return node.target
    return None


_VIEW_METHODS = {"view", "reshape", "expand", "expand_as", "view_as", "reshape_as", "permute",
                 "transpose", "t", "squeeze", "unsqueeze", "flatten", "unflatten", "narrow",
                 "select", "as_strided", "detach", "split", "chunk", "unbind", "diagonal",
                 "movedim", "unfold", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze,
                   torch.permute, torch.transpose, torch.t, torch.narrow, torch.select,
                   torch.split, torch.chunk, torch.unbind, torch.movedim, torch.diagonal,
                   torch.detach}


def _is_view(node: object) -> bool:
    """Whether ``node`` may return a view of (memory shared with) its first argument."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


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
    for node in list(gm.graph.nodes):
        twin = inplace_target(gm, node)
        if twin is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        root = written_root(mutated, written)
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
            written[root] = node
    output = gm.graph.find_nodes(op="output")[0]
    for root, value in written.items():
        with gm.graph.inserting_before(output):
            gm.graph.call_function(write_back, (root, value))
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
    writes into a view, or into a value of which a view taken before it is read after it."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.setitem:
            return f"an item assignment ({node.name}) writes into a tensor in place"
        twin = inplace_target(gm, node)
        if twin is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        if node.op == "call_method" and not hasattr(torch.Tensor, twin):
            return f"in-place op {node.target} ({node.name}) has no out-of-place twin"
        if _read_through_another_alias(node, order):
            return (f"in-place op {node.target} ({node.name}) writes into memory that another "
                    "value of the graph shares (a view)")
    return ""


def _read_through_another_alias(node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether the memory the in-place ``node`` writes is seen after it through another value
    than the one it writes (which the rewrite makes every later reader read): the base its
    value is a view of, or a view of that base taken before ``node``, read after it; or the base
    is a graph input or a buffer (the caller or the module would see the write). A write into a
    view nothing else reads later (an in-place dropout after a ``flatten``) is made out of place
    like any other."""
    written = node.args[0]
    base = written
    while _is_view(base):
        base = base.args[0]
    if base is not written and base.op in ("placeholder", "get_attr"):
        return True
    aliases, stack = set(), [base]
    while stack:
        value = stack.pop()
        if value not in aliases:
            aliases.add(value)
            stack.extend(u for u in value.users if _is_view(u) and u.args[0] is value
                         and order[u] < order[node])
    return any(order[r] > order[node] for a in aliases if a is not written
               for r in a.users if r is not node)
