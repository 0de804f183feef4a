"""The backward plan of a training graph, decided before its regions are lowered: which region
inputs never need a gradient, and which convolutions' dgrad applies the ReLU backward of the
region that produced their input (``dgrad_drelu``).

``dx = relu_backward(conv_dgrad(dy, w), x)``, i.e. ``dx * (x > 0)``, equals the ReLU's backward
applied to this dgrad when ``x`` is a ReLU's output (``x > 0`` exactly where the ReLU's input is)
and this convolution is the only reader of ``x``: otherwise the gradients of the other readers
must be added before the ReLU's backward. cuDNN fuses ``relu_backward`` into stride-1 dgrad only
(docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"), so the convolution must have stride 1,
dilation 1 and one group. The producing region then passes that gradient through its ReLU unchanged
(its plan's ``masked_outputs``, known once the consumer's backend is: only a derived backward
masks).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import torch
import torch.fx as fx

from ..ir.region import BackwardPlan, Region, called_region

__all__ = ["backward_plans", "with_masked_outputs"]


def backward_plans(gm: fx.GraphModule, frozen: frozenset[str]
                   ) -> tuple[dict[Region, BackwardPlan], dict[Region, tuple[Region, str]]]:
    """The backward plan of every region of training graph ``gm`` (``frozen``: names of its
    placeholders that never need a gradient), and the dgrad_drelu pairs
    ``{consumer region: (producer region, ReLU node name)}`` (see the module docstring); the
    plans' ``masked_outputs`` are empty (:func:`with_masked_outputs` fills them)."""
    grad_free = _grad_free_nodes(gm, frozen)
    plans: dict[Region, BackwardPlan] = {}
    pairs: dict[Region, tuple[Region, str]] = {}
    for call in gm.graph.nodes:
        region = called_region(gm, call)
        if region is None:
            continue
        producer, reason = _relu_producer(gm, region, call)
        plans[region] = BackwardPlan(no_grad_inputs=frozenset(_no_grad_inputs(region, call,
                                                                               grad_free)),
                                     dgrad_drelu=producer is not None, dgrad_drelu_reason=reason)
        if producer is not None:
            pairs[region] = producer
    return plans, pairs


def with_masked_outputs(plans: dict[Region, BackwardPlan],
                        pairs: dict[Region, tuple[Region, str]],
                        masks: Callable[[Region], bool]) -> dict[Region, BackwardPlan]:
    """``plans`` with each producer's ``masked_outputs``: the ReLU outputs whose consumer's
    backward masks (``masks(consumer)``: a derived backward does, PyTorch autograd does not)."""
    masked: dict[Region, set[str]] = {}
    for consumer, (producer, relu) in pairs.items():
        if masks(consumer):
            masked.setdefault(producer, set()).add(relu)
    return {r: dataclasses.replace(p, masked_outputs=frozenset(masked[r])) if r in masked else p
            for r, p in plans.items()}


def _relu_producer(gm: fx.GraphModule, region: Region, call: fx.Node
                   ) -> tuple[tuple[Region, str] | None, str]:
    """``((producer region, ReLU node name), "")`` when ``region``'s dgrad can be fused with
    that ReLU's backward (see the module docstring), else ``(None, reason)``."""
    conv = region.conv
    _, _, _, stride, _, dilation, groups = conv.args
    if any(s != 1 for s in stride):
        return None, (f"stride {'x'.join(map(str, stride))}: cuDNN fuses relu_backward into "
                      f"stride-1 dgrad only")
    if any(d != 1 for d in dilation) or groups != 1:
        return None, "dilated or grouped convolution"
    image = conv.args[0]
    if image.op != "placeholder":
        return None, f"the convolution reads {image.name}, computed in the region (a prologue)"
    if len(image.users) != 1:
        return None, "the region reads the convolution input elsewhere too"
    placeholders = list(region.graph_module.graph.find_nodes(op="placeholder"))
    source = call.args[placeholders.index(image)]
    if not isinstance(source, fx.Node):
        return None, "the convolution input is a constant"
    producer = called_region(gm, source.args[0]) if source.target is operator.getitem else None
    if producer is None:
        return None, f"the convolution input is not a region output ({source.name})"
    value = producer.output_nodes[source.args[1]]
    if value.target is not torch.relu:
        after = (" (an add after its ReLU)" if value.target is torch.add
                 and getattr(value.args[0], "target", None) is torch.relu else "")
        return None, (f"the convolution input is {producer.region_id}'s {value.name}{after}, "
                      f"not a ReLU output")
    if len(value.users) != 1 or len(source.users) != 1 or call.args.count(source) != 1:
        return None, (f"{producer.region_id}'s ReLU output {value.name} has other readers, "
                      f"whose gradients add before its backward")
    return (producer, value.name), ""


def _grad_free_nodes(gm: fx.GraphModule, frozen: frozenset[str]) -> set[fx.Node]:
    """Nodes of ``gm`` computed from the placeholders named in ``frozen`` (and constants) alone,
    through ops that are not regions: their values can never need a gradient."""
    free: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.name in frozen:
                free.add(n)
        elif n.op in ("call_function", "call_method") and n.all_input_nodes and all(
                a in free for a in n.all_input_nodes):
            free.add(n)
    return free


def _no_grad_inputs(region: Region, call: fx.Node, grad_free: set[fx.Node]) -> set[str]:
    """Names of the region's inputs fed from a node in ``grad_free``."""
    return {ph.name for ph, arg in zip(region.graph_module.graph.find_nodes(op="placeholder"),
                                        call.args)
            if isinstance(arg, fx.Node) and arg in grad_free}
