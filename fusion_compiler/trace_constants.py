"""Tensors a trace makes from constant arguments (``torch.ones(4)``, ``torch.zeros(3)``: fx runs
the call once and keeps its result as a ``_tensor_constant`` attribute of the graph): a write
into one is refused by the capture (:func:`constants_written`), and one returned is copied at
each call (:func:`fresh_constant_outputs`), as eager makes a new tensor at each call."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .ir.aliasing import view_base, view_chain
from .ir.ops import writes_in_place

__all__ = ["constants_written", "fresh_constant_outputs"]


def _is_constant(gm: fx.GraphModule, node: object) -> bool:
    """Whether ``node`` is, or may share memory with, a tensor the trace made from constant
    arguments (``torch.ones(4)``: fx keeps it as a ``_tensor_constant`` attribute)."""
    base = view_base(gm, node)
    return isinstance(base, fx.Node) and base.op == "get_attr" and str(base.target).startswith(
        "_tensor_constant")


def constants_written(gm: fx.GraphModule) -> list[str]:
    """The tensors a trace made from constant arguments that a node of ``gm`` writes in place
    (``w.mul_(s)``, ``w[i] = 0``), directly or through a view, each as ``constant (by op)``."""
    found = []
    for node in gm.graph.nodes:
        setitem = node.target in (operator.setitem, "__setitem__", torch.Tensor.__setitem__)
        if (setitem or writes_in_place(node)) and node.args and _is_constant(gm, node.args[0]):
            name = getattr(node.target, "__name__", node.target)
            found.append(f"{view_base(gm, node.args[0]).target} (by {name})")
    return found


def fresh_constant_outputs(gm: fx.GraphModule) -> None:
    """An output that is a tensor the trace made from constant arguments (``return y,
    torch.zeros(3)``), or a view of one, is computed from a copy of it at each call, as eager
    makes a new tensor at each call: the graph returned that one tensor at every call, and a
    caller's write into one call's output changed every later call's. Outputs whose constants
    share memory (``return z, z[:2]``: fx keeps each use, and a view taken on the spot, as
    constants of their own) share one copy of it, as eager's share their tensor."""
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    leaves = [n for n in tree_flatten(output.args)[0] if isinstance(n, fx.Node)]
    whole: dict[tuple, fx.Node] = {}  # a copy of each constant storage the outputs reach
    for leaf in dict.fromkeys(leaves):
        if not _is_constant(gm, leaf):
            continue
        chain = view_chain(gm, leaf)
        base, first = chain[-1], chain[-2] if len(chain) > 1 else leaf  # (first: reads base)
        t = getattr(gm, base.target)
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.dtype)
        if key not in whole:
            name = f"_tensor_constant_storage{len(whole)}"
            flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                storage, 0, (storage.nbytes() // t.element_size(),))
            setattr(gm, name, flat)
            start = next(n for n in graph.nodes if n.op != "placeholder")  # before any use
            with graph.inserting_before(start):
                whole[key] = graph.call_function(torch.clone, (graph.get_attr(name),))
        with graph.inserting_after(whole[key]):
            copy = graph.call_function(torch.as_strided, (whole[key], tuple(t.shape), t.stride(),
                                                          t.storage_offset()))
        (output if first is base else first).replace_input_with(base, copy)
    if whole:
        gm.graph.lint()
        gm.recompile()
