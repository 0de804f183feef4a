"""Concurrent branches (a post-lowering pass): a short branch's cuDNN region runs on a second CUDA
stream (``compile(concurrent_branches=True)``, opt-in: it made SE-ResNet9's forward faster on the
RGB input at N=128 and slower on the depth input at N=512; measurements: docs/decisions.md,
"``concurrent_branches`` off by default").

A residual block with a downsample convolution forks at its input: the main path (conv1, conv2,
the SE gate) and the downsample convolution read the same value and meet again at the residual
add. One stream runs them one after the other; a small convolution fills few of the GPU's SMs, so
two independent ones overlap well (docs/cudnn.md, "Two convolutions on two streams"). The fuse
pass leaves the join out of the shorter branch's region (``fuse_regions(branches=True)``), and
:func:`run_short_branches_beside` then schedules that region on a second stream:

* **Which regions**: the cuDNN regions off the critical path, the longest path through the graph
  with each region weighted by its convolution FLOPs (``networkx.dag_longest_path``): the short
  branches of forks. All of them share one side stream per device.
* **Fork**: the region's call moves to just after its inputs are made; its kernel makes the side
  stream wait for the current one (everything issued so far), runs there, on a workspace of its
  own (the main stream's may be in use at the same time), and allocates its outputs there.
* **Order**: the other branch's first region takes the fork's outputs as extra inputs that its
  kernel ignores, so a compiled glue runs the fork first.
* **Join**: before the first node that reads an output, ``fusion_compiler::join_side_stream``
  makes the current stream wait for the side stream. The op declares that it mutates the region's
  outputs, so a ``torch.compile``'d glue (Inductor) orders every read of them after it, and it
  takes the region's other inputs too, so none of them is freed, or its memory reused by Inductor
  for another buffer, while the side stream may still read it, and the outputs of the other
  branch's last region on the current stream, so it is not scheduled before that branch. Each
  fork waits for everything issued before it, so memory the side stream allocated and freed is
  reused there only after the main stream's reads.

In a CUDA graph capture the event records and waits become edges of the graph: one replay runs
both branches at once. Outside a capture it costs a few microseconds of host time per region.

Limits: a side branch of several regions joins after each (the next one's fork then also waits
for the current stream's work issued meanwhile), and only cuDNN regions go beside; SE-ResNet9's
and torchvision ResNets' side branches are one downsample region each.
"""

from __future__ import annotations

import operator
from typing import Callable

import networkx as nx
import torch
import torch.fx as fx

from ...ir.ops import conv_flops
from ...ir.region import Region, called_region
from ...runtime.streams import join_side_stream  # noqa: F401  (registers the op the join calls)

__all__ = ["run_short_branches_beside"]


def _on_cudnn(region: Region) -> bool:
    return region.backend == "cudnn" and hasattr(getattr(region.kernel, "__self__", None),
                                                 "run_beside")


def _beside(region: Region) -> None:
    region.kernel.__self__.run_beside()  # a CudnnKernel's call


def run_short_branches_beside(gm: fx.GraphModule,
                              eligible: Callable[[Region], bool] = _on_cudnn,
                              mark: Callable[[Region], None] = _beside) -> list[str]:
    """Schedule each short-branch region of lowered ``gm`` on the side stream (in place; see the
    module doc); returns their region ids. ``eligible`` says which regions may go (default: cuDNN
    regions), ``mark`` makes a region's kernel run on the side stream and raise its ``beside``
    flag (tests pass their own)."""
    graph = gm.graph
    calls = {n: r for n in graph.nodes if (r := called_region(gm, n)) is not None}
    flops = {n: conv_flops(r.conv, r.graph_module) or 0 for n, r in calls.items()}
    dag = nx.DiGraph()
    for node in graph.nodes:
        dag.add_node(node)
        dag.add_edges_from(((inp, node) for inp in node.all_input_nodes),
                           weight=flops.get(node, 0))
    critical = set(nx.dag_longest_path(dag, weight="weight", default_weight=0))
    chosen = [n for n, r in calls.items() if n not in critical and flops[n] > 0 and eligible(r)]
    main = {n for n in calls if n not in chosen}
    for node in chosen:
        _fork_early(graph, dag, node)
        _join_before_readers(gm, dag, node, main)  # before the next edit adds a reader
        _fork_before_other_branch(gm, dag, node, main, calls, eligible)
        mark(calls[node])  # the region's ``stream`` now reads "side" (its kernel's flag)
    if chosen:
        graph.lint()
        gm.recompile()
    return [calls[n].region_id for n in chosen]


def _fork_early(graph: fx.Graph, dag: nx.DiGraph, call: fx.Node) -> None:
    """Move ``call`` to just after the last of its inputs computed from the graph's inputs,
    with the parameter-only nodes it reads (all that come after that input), and its ``getitem``
    outputs right after it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    computed = [n for n in call.all_input_nodes
                if n.op == "placeholder" or any(a.op == "placeholder" for a in nx.ancestors(dag, n))]
    anchor = max(computed, key=order.__getitem__, default=None)
    if anchor is None:
        return
    moved = sorted((n for n in nx.ancestors(dag, call) if order[n] > order[anchor]),
                   key=order.__getitem__)
    moved.append(call)
    moved.extend(sorted((u for u in call.users if u.target is operator.getitem),
                        key=order.__getitem__))
    for node in moved:
        anchor.append(node)
        anchor = node


def _fork_before_other_branch(gm: fx.GraphModule, dag: nx.DiGraph, call: fx.Node,
                              main: set[fx.Node], calls: dict[fx.Node, Region],
                              eligible: Callable[[Region], bool]) -> None:
    """Give the first region on the current stream (in ``main``) after ``call`` that is
    independent of it (the other branch's first) ``call``'s outputs as extra inputs, which its
    kernel ignores (``CudnnKernel`` reads as many inputs as the region has): a compiled glue must
    then run the fork first. Otherwise the fork may come after that region, and as it waits for
    everything issued before it, the side stream would start only when that region is done
    (Inductor's scheduler chose such an order on CPU, torch 2.13, in one of SE-ResNet9's three
    blocks)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    related = nx.ancestors(dag, call) | nx.descendants(dag, call)
    later = [n for n in main if order[n] > order[call] and n not in related
             and eligible(calls[n])]
    if later:
        first = min(later, key=order.__getitem__)
        first.args = (*first.args, *_outputs(call))


def _outputs(call: fx.Node) -> list[fx.Node]:
    return sorted((u for u in call.users if u.target is operator.getitem),
                  key=lambda u: u.args[1]) or [call]


def _join_before_readers(gm: fx.GraphModule, dag: nx.DiGraph, call: fx.Node,
                         main: set[fx.Node]) -> None:
    """Insert ``join_side_stream`` before the first node that reads an output of ``call``
    (joins inserted for other regions do not count: they only hold values).

    Besides the region's outputs and other inputs, the join reads the outputs of the last region
    of the other branch on the current stream (the latest region in ``main`` that the first
    reader depends on and ``call`` does not), so that a compiled glue cannot schedule it before
    that branch's work: Inductor's scheduler moves an op whose inputs are ready (on CPU, torch
    2.13, it put the join right after the fork)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = _outputs(call)
    first = min((r for out in outputs for r in out.users if r not in outputs and r in dag),
                key=order.__getitem__)
    keep = [n for n in call.all_input_nodes if n.op != "get_attr"]
    other_branch = nx.ancestors(dag, first) - nx.ancestors(dag, call) - {call}
    last = max(other_branch & main, key=order.__getitem__, default=None)
    if last is not None:
        keep += [o for o in _outputs(last) if o in other_branch]
    with graph.inserting_before(first):
        graph.call_function(torch.ops.fusion_compiler.join_side_stream.default, (outputs, keep))
