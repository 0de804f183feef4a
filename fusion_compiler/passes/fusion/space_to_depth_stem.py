"""space_to_depth_stem: a region whose 1x1 convolution reads SpaceToDepth(4) of an image takes the
SpaceToDepth as its prologue, so that the ``triton_stem`` backend runs the whole stem as one kernel
(:mod:`fusion_compiler.kernels.space_to_depth`) and no other backend builds anything for it.

It runs after ``verify`` (the SpaceToDepth's view, permute and reshape are not canonical region
ops), for CUDA inference where Triton runs, and only for regions the kernel takes (its shapes,
dtypes and epilogue: :func:`~fusion_compiler.kernels.space_to_depth.kernel_reason`,
:func:`~fusion_compiler.kernels.space_to_depth.epilogue_program`); the others stay as they are,
and why is logged. The SpaceToDepth is found in either form the pre-fusion passes leave it
(:func:`~fusion_compiler.passes.pre_fusion.rewrites.space_to_depth_source`), also followed by the
cast to the weight's dtype that the ``autocast`` pass writes for an fp32 image (the kernel then
rounds the image as it loads it).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ...ir.ops import dtype_cast, node_device
from ...ir.region import Region, called_region
from ...kernels.space_to_depth import epilogue_program, kernel_reason
from ..pre_fusion.rewrites import pointwise_conv, space_to_depth_source

__all__ = ["space_to_depth_stems"]

log = logging.getLogger("fusion_compiler")


def _absorbed(region: Region, image: fx.Node, x: fx.Node, chain: list[fx.Node],
              block: int) -> Region:
    """A region like ``region`` that reads ``x`` at its placeholder ``image`` and computes
    ``chain`` (the SpaceToDepth nodes of the outer graph, ``x`` -> the old image) itself, before
    its convolution."""
    gm = region.graph_module
    g = gm.graph
    env = {x: image}
    with g.inserting_before(region.conv):
        for node in chain:
            env[node] = g.node_copy(node, lambda a: env[a])
    region.conv.replace_input_with(image, env[chain[-1]])
    image.meta["val"] = x.meta["val"]
    g.lint()
    gm.recompile()
    return Region(region.region_id, gm, [n.name for n in chain] + list(region.nodes),
                  space_to_depth=block)


def _source(node: object, dtype: torch.dtype) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """:func:`~fusion_compiler.passes.pre_fusion.rewrites.space_to_depth_source` of ``node``, or of
    what ``node`` casts when it is ``.to(dtype)`` of a SpaceToDepth, ``dtype`` the weight's (the
    autocast pass's cast; the cast then ends the chain). ``None`` for a cast to another dtype."""
    cast = dtype_cast(node)
    if cast is not None:
        found = space_to_depth_source(node.args[0]) if cast == dtype else None
        return None if found is None else (found[0], found[1], [*found[2], node])
    return space_to_depth_source(node)


def space_to_depth_stems(gm: fx.GraphModule) -> fx.GraphModule:
    """Give each region whose 1x1 convolution reads SpaceToDepth(4) of an image, and
    which the stem kernel takes, the SpaceToDepth as its prologue (in place; see the module
    docstring). The region then reads the image, its pattern starts with ``[space_to_depth4]``,
    and the SpaceToDepth nodes no other node reads leave the graph."""
    changed = []
    for call in list(gm.graph.nodes):
        region = called_region(gm, call)
        if region is None:
            continue
        conv = region.conv
        image, weight = conv.args[0], conv.args[1]
        if (not pointwise_conv(conv) or conv.args[2] is not None or image.op != "placeholder"
                or weight.op != "placeholder" or len(image.users) != 1):
            continue
        names = [n.name for n in region.graph_module.graph.find_nodes(op="placeholder")]
        at = names.index(image.name)
        found = _source(call.args[at], weight.meta["val"].dtype)
        if found is None:
            continue
        x, block, chain = found
        outside = {a for n in chain for a in n.all_input_nodes} - {x, *chain}
        reason = (f"its shape is computed by {', '.join(sorted(a.name for a in outside))}"
                  if outside else kernel_reason(x.meta["val"], weight.meta["val"], block))
        fit = reason or epilogue_program(region, node_device(x))
        if isinstance(fit, str):
            log.info("region %s: SpaceToDepth stem left as it is: %s", region.region_id, fit)
            continue
        setattr(gm, call.target, _absorbed(region, image, x, chain, block))
        args = list(call.args)
        args[at] = x
        call.args = tuple(args)
        for node in reversed(chain):
            if not node.users:
                gm.graph.erase_node(node)
        changed.append(region.region_id)
    if changed:
        log.info("regions %s run SpaceToDepth, conv and epilogue as one Triton kernel",
                 ", ".join(changed))
        gm.graph.lint()
        gm.recompile()
    return gm
