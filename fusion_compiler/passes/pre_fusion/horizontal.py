"""Horizontal fusion: sibling convolutions that read the same image with the same geometry become
one convolution with their weights concatenated along output channels.

A residual block with a downsample reads its input twice: the block's first convolution and the
downsample convolution (SE-ResNet9's ``AvgPool2d(3, s, 1) + conv1x1``, which
:func:`~fusion_compiler.passes.pre_fusion.rewrites.avgpool_conv` turns into a 3x3, stride-s
convolution, the first convolution's geometry). Two GEMMs with ``M = N*HO*WO`` rows and ``K1`` and
``K2`` columns become one of ``K1 + K2`` columns: at small ``M`` (SE-ResNet9 layers 1-3) each
convolution alone leaves most SMs idle, and the merged one takes little more time than either
(measurements: docs/decisions.md, "Horizontal fusion of sibling convolutions").

The rewrite, for siblings ``c_1 .. c_m`` of image ``x``:

* ``y = conv2d(x, cat([w_1 .. w_m]), cat(biases) or None, stride, padding, dilation, 1)``; the
  concatenation reads parameter-only values (as
  :func:`fusion_compiler.passes.post_lowering.hoist.parameter_only` defines them), so in
  inference it is computed once per parameter version, not at every call;
* each ``c_i`` is replaced by ``narrow(y, 1, offset_i, K_i)``, a view;
* the sibling with a non-empty **epilogue chain** (pointwise ops whose other operand is a scalar,
  and unary activations, each read by the next alone: what a region fuses after a convolution)
  has that chain moved onto ``y`` itself, so it still fuses into the merged convolution's region;
  the chain then also runs on the other siblings' channels, whose values nothing reads: the region
  writes ``y`` and the chain's output, each of ``K1 + K2`` channels, and each reader takes its
  channels as a view. At most one sibling may have such a chain, and no sibling may be read
  by an op that its region would have fused but the merged region cannot take (an activation, or
  a binary op with a per-channel, spatial or scalar operand left after the chain: torchvision's
  batch-norm-folded siblings stay apart); a join (a binary op with a full operand, the residual
  add of a downsample) may leave the region.

Every value is what the separate convolutions computed (each output channel is its own dot
product; the chain is pointwise); where a join leaves a region, the value is rounded to the
I/O type before the join instead of after it. It runs in CUDA inference
(``compile(horizontal_fusion=True)``, the default); cuDNN regions read a channel view in place
(:func:`fusion_compiler.ir.region.channel_view_total`).

Siblings merge when: all are ``conv2d`` with ``groups == 1``; same image node, stride, padding,
dilation, kernel size, dtype; weights (and biases, all or none) are computed from parameters
only; every output channel count is a multiple of 8 (a view then starts 16-byte aligned in fp16,
as cuDNN's vectorized engines need: docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)").
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...ir.ops import BINARY, UNARY, eliminate_dead_code, is_conv
from ...ir.region import CHANNEL_VIEW, operand_kind
from ..post_lowering.hoist import parameter_only

__all__ = ["horizontal_fusion", "CHANNEL_ALIGNMENT"]

#: Output channel counts of merged siblings are multiples of this (16 bytes of fp16).
CHANNEL_ALIGNMENT = 8


def _val(node: object):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _signature(conv: fx.Node, const: set[fx.Node]) -> tuple | None:
    """What siblings must share, or ``None`` when ``conv`` cannot merge (``const``: the
    parameter-only nodes, :func:`~fusion_compiler.passes.post_lowering.hoist.parameter_only`)."""
    x, w = _val(conv.args[0]), _val(conv.args[1])
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() != 4:
        return None
    _, weight, bias, stride, padding, dilation, groups = conv.args
    if groups != 1 or w.shape[0] % CHANNEL_ALIGNMENT or weight not in const:
        return None
    if bias is not None and bias not in const:
        return None
    return (tuple(w.shape[1:]), tuple(stride), tuple(padding), tuple(dilation), w.dtype,
            bias is None)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _scalar(arg: object, const: set[fx.Node]) -> bool:
    if isinstance(arg, (int, float)):
        return True
    val = _val(arg)
    return isinstance(val, torch.Tensor) and val.numel() == 1 and arg in const


def _chain(conv: fx.Node, const: set[fx.Node]) -> list[fx.Node]:
    """The epilogue chain after ``conv`` that can move onto the merged output (module doc)."""
    chain, value = [], conv
    while len(value.users) == 1:
        user = next(iter(value.users))
        if user.op != "call_function" or (user.target not in BINARY and user.target not in UNARY):
            break
        if user.target in BINARY:
            if user.args[0] is not value or not _scalar(user.args[1], const):
                break
        elif user.args[0] is not value or any(isinstance(a, fx.Node) for a in user.args[1:]):
            break
        chain.append(user)
        value = user
    return chain


def _would_fuse(value: fx.Node) -> bool:
    """Whether a reader of ``value`` is an op the fuse pass would put in ``value``'s region as
    epilogue and the merge would leave to PyTorch instead: an activation, or a binary op whose
    other operand is not a full tensor of ``value``'s shape. A binary op with a full operand (a
    join of two branches: the residual add of a downsample) may leave the region: it then
    joins the other branch's work (SE-ResNet9's ``se_scale`` kernel takes it)."""
    shape = _val(value).shape if isinstance(_val(value), torch.Tensor) else None
    for user in value.users:
        if user.op != "call_function":
            continue
        if user.target in UNARY:
            return True
        if user.target in BINARY:
            other = user.args[1] if user.args[0] is value else user.args[0]
            val = _val(other)
            if not (isinstance(val, torch.Tensor) and val.shape == shape):
                return True
            if len(shape) == 4 and operand_kind(tuple(val.shape),
                                                tuple(shape)) in ("scalar", "channel"):
                return True  # of a 1x1 map at N = 1: a per-channel operand, no join
    return False


def _siblings(gm: fx.GraphModule, const: set[fx.Node]) -> list[list[fx.Node]]:
    groups = []
    for node in gm.graph.nodes:
        by_signature: dict[tuple, list[fx.Node]] = {}
        for user in node.users:
            if is_conv(user) and user.args[0] is node \
                    and (sig := _signature(user, const)) is not None:
                by_signature.setdefault(sig, []).append(user)
        groups += [convs for convs in by_signature.values() if len(convs) > 1]
    return groups


def horizontal_fusion(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge sibling convolutions of ``gm`` (in place; see the module doc). Returns ``gm``."""
    if gm.meta.get("fusion_off"):
        return gm
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    # the merged weight must be parameter-only to be hoisted (computed once per weight version)
    const = parameter_only(graph)
    for convs in _siblings(gm, const):
        chains = {c: _chain(c, const) for c in convs}
        if sum(bool(chain) for chain in chains.values()) > 1 or any(
                _would_fuse(chain[-1] if chain else c) for c, chain in chains.items()):
            continue
        convs.sort(key=order.__getitem__)
        first = convs[0]
        widths = [_val(c.args[1]).shape[0] for c in convs]
        _, _, bias, stride, padding, dilation, groups = first.args
        # a later sibling's weight, or a chain's scalar, may be made after the first sibling:
        # its parameter-only nodes move before the first, where the merged convolution goes
        moved = [a for c in convs for a in c.args[1:3] if isinstance(a, fx.Node)]
        moved += [a for chain in chains.values() for n in chain for a in n.args[1:]
                  if isinstance(a, fx.Node)]
        for arg in moved:
            for node in sorted(_ancestors(arg) | {arg}, key=order.__getitem__):
                if order[node] > order[first]:
                    first.prepend(node)
        with graph.inserting_before(first):
            weight = graph.call_function(torch.cat, ([c.args[1] for c in convs], 0))
            cat_bias = None if bias is None else graph.call_function(
                torch.cat, ([c.args[2] for c in convs], 0))
            merged = graph.call_function(torch.conv2d, (first.args[0], weight, cat_bias, stride,
                                                        padding, dilation, groups))
            value = merged
            for c in convs:
                for node in chains[c]:  # the chain, re-made on the merged output
                    value = graph.call_function(node.target, (value, *node.args[1:]),
                                                dict(node.kwargs))
        offset = 0
        for c, width in zip(convs, widths):
            source = value if chains[c] else merged
            with graph.inserting_before(first):
                view = graph.call_function(torch.narrow, (source, 1, offset, width))
            view.meta[CHANNEL_VIEW] = sum(widths)
            old = chains[c][-1] if chains[c] else c
            old.replace_all_uses_with(view)
            offset += width
        for c in convs:
            for node in reversed(chains[c]):
                graph.erase_node(node)
            graph.erase_node(c)
        order = {n: i for i, n in enumerate(graph.nodes)}
    eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return gm
