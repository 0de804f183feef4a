"""Hoisting: parameter-only subgraphs computed apart from the forward, so that an inference CUDA
graph recomputes them only when the parameters they read change.

Rewrites leave work in the graph that depends on parameters alone: the AvgPool + 1x1 downsample
weight ``w * (1/9)`` expanded to 3x3, eval batch norm's ``gamma * rsqrt(var + eps)`` scale and
shift, concatenated weights of merged convolutions. :func:`hoist_parameter_subgraphs` moves every
such node into a separate graph and replaces what the rest of the graph reads with tensors held by
the graph module. Who runs the graph keeps those tensors current: a CUDA graph through its
derivation prologue (:class:`fusion_compiler.runtime.derivations.Derivations`: a content
fingerprint of the parameters, the values rewritten on the GPU when it changes), any other caller
with :meth:`HoistedParameters.refresh` before each call (which recomputes them all: no host-side
test of whether a parameter changed is sound, docs/decisions.md, "Derived weights: a content
fingerprint, not version counters").

Only for graphed inference on CUDA: with autograd the weight transform must stay in the graph, and
without a CUDA graph nothing is saved by moving it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ...ir.aliasing import view_chain
from ...ir.ops import eliminate_dead_code

__all__ = ["HoistedParameters", "hoist_parameter_subgraphs", "hoist_parameters", "HOISTED",
           "parameter_only", "returned"]

_PREFIX = "_hoisted_"
HOISTED = "hoisted"
"""The key of ``gm.meta`` under which :func:`hoist_parameters` leaves the
:class:`HoistedParameters` (or ``None``), for the runner to refresh before each call."""


class HoistedParameters:
    """The parameter-only part of a graph module and the tensors it feeds the rest with.

    Attributes:
        graph_module: computes the hoisted values (a tuple) from the parameters it reads.
        names: attribute names, on the rewritten graph module, of the hoisted values.
        sources: the parameters and buffers the values depend on.
    """

    def __init__(self, owner: fx.GraphModule, graph_module: fx.GraphModule, names: list[str],
                 sources: list[torch.Tensor]):
        self.owner = owner
        self.graph_module = graph_module
        self.names = names
        self.sources = sources

    def refresh(self) -> None:
        """Recompute the hoisted values (all of them) into their tensors, in place: a CUDA graph
        that captured their addresses keeps reading the right memory."""
        # normal tensors also under the caller's inference_mode (an inference tensor cannot be
        # updated in place outside it); no_grad second: inference_mode(False) turns grad mode
        # back on, and the values then grew an autograd history at every refresh
        with torch.inference_mode(False), torch.no_grad():
            values = self.graph_module()
            for name, value in zip(self.names, values):
                current = getattr(self.owner, name, None)
                if (isinstance(current, torch.Tensor) and current.shape == value.shape
                        and current.dtype == value.dtype and current.device == value.device):
                    current.copy_(value)
                else:
                    fmt = torch.channels_last if value.dim() == 4 else torch.contiguous_format
                    self.owner.register_buffer(
                        name, torch.empty_like(value, memory_format=fmt).copy_(value),
                        persistent=False)


def _hoistable(node: fx.Node, const: set[fx.Node]) -> bool:
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    inputs = node.all_input_nodes
    return bool(inputs) and all(i in const for i in inputs)


def parameter_only(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of ``graph`` computed from parameters and buffers alone: ``get_attr`` nodes, and
    pure calls whose every input is such a node (what :func:`hoist_parameter_subgraphs` moves
    out of the graph), except the calls an output may share memory with (:func:`returned`)."""
    const: set[fx.Node] = set()
    kept = returned(graph)
    for node in graph.nodes:
        if node.op == "get_attr" or (node not in kept and _hoistable(node, const)):
            const.add(node)
    return const


def returned(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose memory an output of ``graph`` may be: the outputs, and through views
    (:func:`~fusion_compiler.ir.aliasing.view_chain`) what they are views of. Computed in the
    graph, not hoisted: a hoisted value is one tensor the graph reads at every call, and eager
    returns a new tensor at each call (``return y, self.scale * 2``), so a caller's write into one
    call's output would reach every later call's."""
    output = graph.find_nodes(op="output")[0]
    return {n for leaf in tree_flatten(output.args)[0]
            for n in view_chain(graph.owning_module, leaf) if isinstance(n, fx.Node)}


def hoist_parameter_subgraphs(gm: fx.GraphModule) -> HoistedParameters | None:
    """Move the nodes of ``gm`` that depend only on parameters/buffers into a separate graph.

    ``gm`` is rewritten in place: each hoisted value another node reads becomes a ``get_attr`` of a
    tensor attribute ``_hoisted_<i>`` (computed now, refreshed by
    :meth:`HoistedParameters.refresh`). Returns ``None`` (and leaves ``gm`` alone) when there is
    nothing to hoist.
    """
    graph = gm.graph
    const = parameter_only(graph)
    frontier = [n for n in graph.nodes if n in const and n.op != "get_attr"
                and isinstance(n.meta.get("val"), torch.Tensor)
                and any(u not in const for u in n.users)]
    if not frontier:
        return None
    sources_nodes = [n for n in graph.nodes if n.op == "get_attr" and n in const]
    sources = [_fetch(gm, n.target) for n in sources_nodes]
    if any(not isinstance(t, torch.Tensor) for t in sources):
        return None

    prep = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in const:
            env[node] = prep.node_copy(node, lambda a: env[a])
    prep.output(tuple(env[n] for n in frontier))
    prep_module = fx.GraphModule(gm, prep)

    names = [f"{_PREFIX}{i}" for i in range(len(frontier))]
    hoisted = HoistedParameters(gm, prep_module, names, sources)
    hoisted.refresh()  # the attributes exist before get_attr nodes name them
    first = next(iter(graph.nodes))
    for name, node in zip(names, frontier):
        with graph.inserting_before(first):
            attr = graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr, delete_user_cb=lambda user: user not in const)
    eliminate_dead_code(graph)
    gm.recompile()
    return hoisted


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def hoist_parameters(gm: fx.GraphModule) -> fx.GraphModule:
    """The pass form of :func:`hoist_parameter_subgraphs`: ``gm`` rewritten in place, the
    :class:`HoistedParameters` (or ``None``) left in ``gm.meta[HOISTED]``."""
    gm.meta[HOISTED] = hoist_parameter_subgraphs(gm)
    return gm
