"""Multi-tensor batching: the same elementwise op applied to many small tensors becomes one
multi-tensor op (``torch._foreach_*``) over the list of them.

What it is for: the hoisted values a CUDA graph recomputes with PyTorch ops at every replay
(:mod:`fusion_compiler.runtime.derivations`, the values outside its gather algebra) are mostly
the scale and shift of every eval-mode batch norm, each folded by the same six small ops
(``var + eps``, ``rsqrt``, two products, a negation, a sum; with half-precision parameters also
their reads in fp32 and the two roundings back, casts batched by concatenation, as no
multi-tensor cast exists): in ResNet-50, 53 batch norms, 318
kernels of a few microseconds each and a copy per value at every replay (an H200 profile of
2026-11-27 counted 485 GPU operations per replay). Batched, that is one multi-tensor launch per
op and chunk of tensors (``multi_tensor_apply``,
``aten/src/ATen/native/cuda/MultiTensorApply.cuh``).

Each op keeps its arithmetic: ``torch._foreach_add(xs, c)`` computes ``torch.add(x, c)`` for each
``x`` of ``xs`` (same type promotion; a list of mixed dtypes or devices runs one op per tensor).
"""

from __future__ import annotations

import collections
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ir.ops import dtype_cast, writes_in_place

__all__ = ["batched"]

_UNARY: dict[Any, Callable[..., Any]] = {
    torch.rsqrt: torch._foreach_rsqrt, torch.sqrt: torch._foreach_sqrt,
    torch.neg: torch._foreach_neg, operator.neg: torch._foreach_neg,
    torch.reciprocal: torch._foreach_reciprocal,
    "rsqrt": torch._foreach_rsqrt, "sqrt": torch._foreach_sqrt, "neg": torch._foreach_neg,
    "reciprocal": torch._foreach_reciprocal,
}
_BINARY: dict[Any, Callable[..., Any]] = {
    torch.add: torch._foreach_add, operator.add: torch._foreach_add,
    torch.sub: torch._foreach_sub, operator.sub: torch._foreach_sub,
    torch.mul: torch._foreach_mul, operator.mul: torch._foreach_mul,
    torch.div: torch._foreach_div, operator.truediv: torch._foreach_div,
    "add": torch._foreach_add, "sub": torch._foreach_sub, "mul": torch._foreach_mul,
    "div": torch._foreach_div,
}


def _tensor(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _cast(node: fx.Node) -> tuple | None:
    """``("cast", dtype, device, source dtype)`` for ``x.to(dtype)`` of a recorded tensor (the
    fp32 reads and roundings of a half-precision batch norm's fold), else ``None``. Sources of
    one dtype only form a group: concatenated with another dtype they would be promoted first,
    and an integer joined with fp16 becomes fp16 (257 -> 256, 70000 -> inf; found by a review,
    session 42)."""
    dtype = dtype_cast(node)
    if dtype is not None and _tensor(node) and _tensor(node.args[0]):
        return ("cast", dtype, str(node.meta["val"].device), node.args[0].meta["val"].dtype)
    return None


def _batchable(node: fx.Node) -> tuple | None:
    """``(multi-tensor op, how its second argument is given)`` for an elementwise op on a tensor
    (a second tensor, ``("tensor",)``; a number, ``("number", its type's name, its repr)``; none:
    the op alone), or ``None``: keyword arguments (``alpha``, ``out``), a number first, no
    recorded tensor."""
    if node.op not in ("call_function", "call_method") or node.kwargs or not node.args:
        return None
    if (cast := _cast(node)) is not None:
        return cast
    if not _tensor(node) or not _tensor(node.args[0]):
        return None
    if len(node.args) == 1 and node.target in _UNARY:
        return (_UNARY[node.target],)
    if len(node.args) == 2 and node.target in _BINARY:
        other = node.args[1]
        if _tensor(other):
            return (_BINARY[node.target], ("tensor",))
        if isinstance(other, (int, float)) and not isinstance(other, bool):
            # by type and spelling: 1 and 1.0 promote differently, 0.0 and -0.0 differ in sign
            return (_BINARY[node.target], ("number", type(other).__name__, repr(other)))
    return None


def batched(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (pure work on tensors, its nodes' ``meta["val"]`` recorded) whose
    elementwise ops of the same kind at the same depth (the longest path from the graph's
    inputs) are one multi-tensor op each, its results taken out by index. Nodes come in order of
    depth, which keeps every node after what it reads. Ops that appear once stay as they are; a
    graph with an impure node (an in-place or random op, whose order matters) is copied as it is.

    Args:
        graph: the graph; it is not changed.

    Returns:
        The new graph, with the same outputs.
    """
    nodes = list(graph.nodes)
    if any(n.op in ("call_function", "call_method", "call_module")
           and (n.is_impure() or writes_in_place(n)) for n in nodes):
        copy = fx.Graph()
        copy.output(copy.graph_copy(graph, {}))
        return copy
    depth: dict[fx.Node, int] = {}
    for node in nodes:
        depth[node] = 1 + max((depth[i] for i in node.all_input_nodes), default=0)
    groups: dict[tuple, list[fx.Node]] = collections.defaultdict(list)
    for node in nodes:
        kind = _batchable(node)
        if kind is not None:
            groups[(depth[node], kind)].append(node)
    group_of = {n: key for key, members in groups.items() if len(members) > 1 for n in members}
    index = {n: i for i, n in enumerate(nodes)}
    output = graph.find_nodes(op="output")[0]
    new, env = fx.Graph(), {}
    for node in sorted((n for n in nodes if n is not output), key=lambda n: (depth[n], index[n])):
        if node in env:
            continue
        key = group_of.get(node)
        if key is None:
            env[node] = new.node_copy(node, lambda a: env[a])
            continue
        members = groups[key]
        if key[1][0] == "cast":
            _cast_group(new, env, members, key[1][1])
            continue
        fn, *second = key[1]
        args: tuple = ([env[m.args[0]] for m in members],)
        if second and second[0][0] == "tensor":
            args += ([env[m.args[1]] for m in members],)
        elif second:
            args += (members[0].args[1],)
        batch = new.call_function(fn, args)
        for i, member in enumerate(members):
            env[member] = new.call_function(operator.getitem, (batch, i))
            env[member].meta = dict(member.meta)
    new.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
    return new


def _cast_group(new: fx.Graph, env: dict, members: list[fx.Node], dtype: torch.dtype) -> None:
    """``x.to(dtype)`` of every member (sources of one dtype) as two kernels: the sources
    flattened into one tensor (``torch.cat``), cast once, and split into views of the members'
    shapes. There is no multi-tensor cast; one cast per tensor was one kernel per batch
    norm parameter at every replay."""
    flat = [new.call_method("reshape", (env[m.args[0]], (-1,))) for m in members]
    cast = new.call_method("to", (new.call_function(torch.cat, (flat,)), dtype))
    parts = new.call_function(torch.split, (cast, [m.meta["val"].numel() for m in members]))
    for i, member in enumerate(members):
        part = new.call_function(operator.getitem, (parts, i))
        env[member] = new.call_method("view", (part, tuple(member.meta["val"].shape)))
        env[member].meta = dict(member.meta)
