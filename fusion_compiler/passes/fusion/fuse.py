"""fuse: grow one region around each convolution and contract it into a
:class:`~fusion_compiler.ir.region.Region`.

Rules (cuDNN generic runtime fusion: docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"; the
defaults: docs/decisions.md, "``fuse_prologue`` and ``fuse_reduction`` off by default"):

* **Prologue** (``prologue=True``; off unless ``compile(fuse_prologue=True)``, see
  :func:`fusion_compiler.passes.pipelines`) -- pointwise ``add``/``sub``/``mul``/``div`` ops on the
  conv input whose other operand is a scalar or per-channel tensor (the Fixup ``x + bias`` before
  a conv). The prologue chain is *cloned* into the region, so a value that other nodes also read
  (the Fixup ``a = x + bias1a`` read by conv1 and by the downsample) is recomputed inside each
  region that needs it; a fused prologue also made the convolution kernel slower (measurements:
  docs/decisions.md, "``fuse_prologue`` and ``fuse_reduction`` off by default").
* **Epilogue** -- starting at the conv output, a chain of pointwise ops: binary ops whose other
  operand is ``[1,1,1,1]``, ``[1,K,1,1]``, ``[N,1,P,Q]`` or ``[N,K,P,Q]`` with the chain value as
  first operand (operands of ``add``/``mul`` are swapped when needed), ReLU, clipped ReLU
  (``clamp(x, 0, c)``), sigmoid, tanh, SiLU.
* **Reduction** (``reduction=True``; off unless ``compile(fuse_reduction=True)``) -- at most one
  ``sum(x, [2, 3], keepdim=True)`` (the SE squeeze), as an exit.
* Intermediates that nodes outside the region still read become extra region outputs.
* A region never spans a change of gradient mode (``meta["grad_zone"]``,
  :func:`~fusion_compiler.ir.ops.mark_grad_zones`), prologue included.
* A merge is legal only if the graph with every region contracted to one node stays acyclic,
  checked with ``networkx`` on the quotient graph.

Declined nodes get a reason in ``gm.meta["fusion_reasons"]`` (node name -> text), which the
dump reports for everything left to PyTorch.
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from ...ir.ops import (BINARY, COMMUTATIVE, UNARY, eliminate_dead_code, is_call,
                       is_conv, is_hw_sum, mark_grad_zones)
from ...ir.region import Region, operand_kind

__all__ = ["fuse_regions", "REGION_PREFIX"]

REGION_PREFIX = "region_"
_PROLOGUE_KINDS = {"scalar", "channel"}
_EPILOGUE_KINDS = {"scalar", "channel", "spatial", "full"}


def _val(node: object):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _conv_reason(conv: fx.Node) -> str | None:
    """Why a convolution cannot head a region, or ``None`` if it can."""
    out, x, w = _val(conv), _val(conv.args[0]), _val(conv.args[1])
    if not all(isinstance(t, torch.Tensor) for t in (out, x, w)):
        return "convolution without tensor metadata (input or weight is not a traced tensor)"
    if x.dim() != 4:
        return f"convolution input has rank {x.dim()}, regions need NCHW (rank 4)"
    if tuple(x.shape[2:]) == (1, 1) and tuple(w.shape[2:]) == (1, 1) \
            and tuple(conv.args[4]) == (0, 0) and conv.args[6] == 1 and _se_gate_sized(w):
        return ("a 1x1 convolution of a 1x1 image is a matrix-vector product (a squeeze-and-"
                "excitation layer): left to the glue, where a whole SE gate becomes one kernel "
                "(the pass se_gates); as cuDNN regions these ran slower (docs/decisions.md)")
    return None


def _se_gate_sized(w: torch.Tensor) -> bool:
    """Whether a ``[K, C, 1, 1]`` weight fits the ``se_gate`` kernel as either layer of a gate.
    Larger ones stay regions: left to the glue unmatched, they ran as Inductor convolutions with
    cuDNN layout transforms around them, slower than as regions (measurements: docs/decisions.md,
    "A 1×1 convolution of a 1×1 image left to the glue")."""
    from ...kernels.se_gate import MAX_CHANNELS, MAX_GATE_WEIGHT, MAX_HIDDEN  # noqa: PLC0415

    k, c = w.shape[:2]
    return min(k, c) <= MAX_HIDDEN and max(k, c) <= MAX_CHANNELS and k * c <= MAX_GATE_WEIGHT


def _other_operand(node: fx.Node, chain: fx.Node):
    """``(other, needs_swap)`` for a binary op that reads ``chain``; ``other`` may be a number."""
    a, b = node.args
    if a is chain and b is not chain:
        return b, False
    if b is chain and a is not chain and node.target in COMMUTATIVE:
        return a, True
    return None, False


def _binary_reason(node: fx.Node, chain: fx.Node, allowed: set[str]) -> str | None:
    if len(node.args) != 2 or node.kwargs:
        return f"{node.target.__name__} with extra arguments"
    other, _ = _other_operand(node, chain)
    if other is None:
        return (f"the chain value is the second operand of non-commutative "
                f"{BINARY[node.target]} (cuDNN takes the region value first)")
    if isinstance(other, (int, float)):
        return None
    oval, nval, cval = _val(other), _val(node), _val(chain)
    if not isinstance(oval, torch.Tensor):
        return "operand without tensor metadata"
    if tuple(nval.shape) != tuple(cval.shape):
        return f"result shape {list(nval.shape)} differs from the region value's {list(cval.shape)}"
    if nval.dtype != cval.dtype:
        return f"type promotion {cval.dtype} -> {nval.dtype} (operand dtype {oval.dtype})"
    kind = operand_kind(tuple(oval.shape), tuple(cval.shape))
    if kind == "sample_channel":
        return ("operand shape [N,K,1,1] (a per-sample channel gate) is not a cuDNN epilogue "
                "operand")
    if kind not in allowed:
        return f"operand shape {list(oval.shape)} is not one of {sorted(allowed)}"
    return None


def _pointwise_reason(node: fx.Node, chain: fx.Node, allowed: set[str]) -> str | None:
    """Why ``node`` (a user of ``chain``) cannot extend the region, or ``None`` if it can."""
    if node.meta.get("grad_zone", 0) != chain.meta.get("grad_zone", 0):
        return "the gradient mode changes between the region and this op (a no_grad block)"
    if is_call(node, *BINARY):
        return _binary_reason(node, chain, allowed)
    if is_call(node, *UNARY):
        if node.target is torch.clamp:
            lo, hi = (list(node.args[1:]) + [None, None])[:2]
            if lo != 0 or not isinstance(hi, (int, float)):
                return f"clamp({lo}, {hi}) is not a clipped ReLU (needs clamp(x, 0, c))"
        return None
    return f"{getattr(node.target, '__name__', node.target)} is not a pointwise op cuDNN fuses"


class _Quotient:
    """The fx graph as a networkx DiGraph in which each region is contracted into one node."""

    def __init__(self, graph: fx.Graph):
        self.g = nx.DiGraph()
        for node in graph.nodes:
            self.g.add_node(node)
            for inp in node.all_input_nodes:
                self.g.add_edge(inp, node)
        self.owner: dict[fx.Node, fx.Node] = {}

    def rep(self, node: fx.Node) -> fx.Node:
        return self.owner.get(node, node)

    def can_merge(self, head: fx.Node, node: fx.Node) -> bool:
        """Whether contracting the groups of ``head`` and ``node`` keeps the graph acyclic: it
        does unless one group reaches the other through a third node (the graph is acyclic
        before, so a cycle after must pass through the merged node)."""
        a, b = self.rep(head), self.rep(node)
        if a is b:
            return True
        return not (self._reaches_around(a, b) or self._reaches_around(b, a))

    def _reaches_around(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether a path from ``a`` to ``b`` other than the edge ``a -> b`` exists (the edge is
        left out while ``networkx`` searches, then put back)."""
        direct = self.g.has_edge(a, b)
        if direct:
            self.g.remove_edge(a, b)
        try:
            return nx.has_path(self.g, a, b)
        finally:
            if direct:
                self.g.add_edge(a, b)

    def merge(self, head: fx.Node, node: fx.Node) -> None:
        a, b = self.rep(head), self.rep(node)
        if a is b:
            return
        nx.contracted_nodes(self.g, a, b, self_loops=False, copy=False)
        for n, r in list(self.owner.items()):
            if r is b:
                self.owner[n] = a
        self.owner[b] = a


def _clone_prologue(graph: fx.Graph, conv: fx.Node, claimed: set[fx.Node]) -> list[fx.Node]:
    """Clone the pointwise chain feeding ``conv``'s input next to ``conv``; return the clones."""
    chain = []
    p = conv.args[0]
    while is_call(p, *BINARY) and p not in claimed and isinstance(p.args[0], fx.Node):
        if _binary_reason(p, p.args[0], _PROLOGUE_KINDS) is not None or p.args[0] is p.args[1] \
                or p.meta.get("grad_zone") != conv.meta.get("grad_zone"):  # (another mode)
            break
        chain.append(p)
        p = p.args[0]
    clones: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(conv):
        for node in reversed(chain):
            clone = graph.node_copy(node, lambda a: clones.get(a, a))
            clones[node] = clone
    if chain:
        conv.replace_input_with(chain[0], clones[chain[0]])
    return list(clones.values())


def fuse_regions(gm: fx.GraphModule, *, prologue: bool = True,
                 reduction: bool = True) -> fx.GraphModule:
    """Contract every convolution chain of ``gm`` into a ``Region`` submodule (see module doc).

    Region modules are named ``region_<i>``; their ids ``r0``, ``r1``, ... follow the order in
    which they run. Each returns a tuple.

    Args:
        prologue: fuse pointwise ops on the conv input (else they stay PyTorch ops).
        reduction: fuse the H, W sum as an exit reduction (else it stays a PyTorch op).
    """
    graph = gm.graph
    reasons: dict[str, str] = gm.meta.setdefault("fusion_reasons", {})
    mark_grad_zones(graph)  # (the batch norm fold's nodes too, inserted since CSE marked)
    convs = [n for n in graph.nodes if is_conv(n)]
    if gm.meta.get("fusion_off"):  # in-place writes that shared memory: the graph runs as it is
        reasons.update({conv.name: gm.meta["fusion_off"] for conv in convs})
        return gm
    heads, members = [], {}
    for conv in convs:
        reason = _conv_reason(conv)
        if reason:
            reasons[conv.name] = reason
            continue
        heads.append(conv)
        members[conv] = _clone_prologue(graph, conv, set()) if prologue else []
    eliminate_dead_code(graph)

    quotient = _Quotient(graph)
    claimed: dict[fx.Node, fx.Node] = {}
    for conv in heads:
        for node in members[conv]:
            quotient.merge(conv, node)
        claimed.update({n: conv for n in (*members[conv], conv)})
    for conv in heads:
        region = [*members[conv], conv]
        has_reduction = False
        chain = conv
        while True:
            nxt = None
            for user in list(chain.users):
                if user in claimed or user.op == "output":
                    continue
                if is_hw_sum(user):
                    why = ("reduction fusion is off (fuse_reduction=False)" if not reduction else
                           "a region has at most one reduction" if has_reduction else None)
                else:
                    why = _pointwise_reason(user, chain, _EPILOGUE_KINDS)
                    if why is None and nxt is not None:
                        why = f"the region already continues through {nxt.name}"
                if why is None and not quotient.can_merge(conv, user):
                    why = "fusing it would create a cycle through nodes outside the region"
                if why is not None:
                    reasons.setdefault(user.name, f"not fused into the region of {conv.name}: {why}")
                    continue
                reasons.pop(user.name, None)
                if is_hw_sum(user):
                    has_reduction = True
                elif is_call(user, *BINARY) and _other_operand(user, chain)[1]:
                    user.args = (user.args[1], user.args[0])
                quotient.merge(conv, user)
                claimed[user] = conv
                region.append(user)
                if not is_hw_sum(user):
                    nxt = user
            if nxt is None:
                break
            chain = nxt
        members[conv] = region

    partitions = [{n: None for n in members[c]} for c in heads]
    if not partitions:
        return gm
    fused = fuse_by_partitions(gm, partitions, prefix=REGION_PREFIX, always_return_tuple=True)
    absorbed = {f"{REGION_PREFIX}{i}": [n.name for n in members[c]] for i, c in enumerate(heads)}
    calls = [n for n in fused.graph.nodes if n.op == "call_module" and n.target in absorbed]
    for k, call in enumerate(calls):  # ids follow the order in which regions run
        setattr(fused, call.target, Region(f"r{k}", getattr(fused, call.target), absorbed[call.target]))
    fused.meta["fusion_reasons"] = reasons
    fused.graph.lint()
    fused.recompile()
    return fused
