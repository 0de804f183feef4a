"""What the capture does to a graph Dynamo handed over (the ``torch.compile`` door): the
checkpoints whose body writes in place inlined, and the grad modes made the ones the passes and
runners know (:func:`~.grad_modes.dynamo_grad_modes`)."""

from __future__ import annotations

import logging
import operator

import torch.fx as fx

from .grad_modes import dynamo_grad_modes
from .ir.ops import calls_named, writes_in_place
from .random_ops import draws

__all__ = ["dynamo_graph"]

log = logging.getLogger("fusion_compiler")


def dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a copy of Dynamo's graph) ready for the passes: see the module docstring."""
    gm = _inline_writing_checkpoints(gm)
    dynamo_grad_modes(gm)  # (Dynamo's modes are constants: it guards on the caller's)
    return gm


_SAID = [False]  # the WARNING of _inline_writing_checkpoints given


def _inline_writing_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Dynamo's activation checkpoint op (``tag_activation_checkpoint``, its body a graph module
    taking the module's tensors as inputs) whose body writes an input in place (a batch norm's
    ``num_batches_tracked.add_(1)``): the body's nodes replace the op, so the write is
    functionalized with the graph's (once per call, as Inductor does; before shape propagation,
    which gives the body's nodes their values). Run as the op, the write
    moves the version of an input the checkpoint saved, and the backward's recompute raised
    "modified by an inplace operation". So is a body that draws random numbers
    (:func:`~.random_ops.draws`: dropout): run as the op, the backward's recompute drew other
    numbers than the forward (dropout's gradient took another mask: 0.17 off on a weight
    gradient of 0.29, as with ``backend="eager"``; ``backend="aot_eager"`` gives eager's). No
    memory is saved there; other checkpoints stay."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not calls_named(node, "tag_activation_checkpoint") or \
                not node.args or getattr(node.args[0], "op", None) != "get_attr":
            continue
        body = getattr(gm, node.args[0].target, None)
        if not isinstance(body, fx.GraphModule) or not any(
                writes_in_place(n) or draws(n) for n in body.graph.nodes) \
                or any(n.op in ("get_attr", "call_module") for n in body.graph.nodes) \
                or not all(u.target is operator.getitem for u in node.users):
            continue
        env = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[1:]))
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "output":
                    outputs = fx.node.map_arg(inner.args[0], env.__getitem__)
                elif inner.op != "placeholder":
                    env[inner] = graph.node_copy(inner, env.__getitem__)
        for use in list(node.users):
            use.replace_all_uses_with(outputs[use.args[1]])
            graph.erase_node(use)
        attr = node.args[0]
        graph.erase_node(node)
        if not attr.users:
            graph.erase_node(attr)
        if any(map(writes_in_place, body.graph.nodes)) and not _SAID[0]:  # once per process
            _SAID[0] = True
            log.warning("a torch.utils.checkpoint body writing in place runs once: a batch norm's "
                        "statistics are updated once a step, eager's twice (no memory is saved)")
    gm.recompile()
    return gm
