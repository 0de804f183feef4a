"""Post-lowering rewrites of squeeze-and-excitation blocks into this package's kernels
(:mod:`fusion_compiler.kernels.se_gate`), for CUDA inference where Triton runs: ``se_gates`` makes a
gate (spatial mean, linear or 1x1 convolution, ReLU or SiLU, linear or 1x1 convolution, sigmoid or
hard sigmoid) one :func:`~fusion_compiler.kernels.se_gate.se_gate` call, one kernel where Inductor
makes three or four and eager PyTorch six; ``se_scales`` then folds the multiply by the gate and the
block's tail after it (residual add, ReLU, a one-element bias) into the gate's kernel
(:func:`~fusion_compiler.kernels.se_gate.se_scale`). They run on the graph that runs, eager glue or
Inductor's, so a graph whose glue is nothing else needs no Inductor
(:func:`fusion_compiler.passes.glue.inductor_work`)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import dtype_cast, eliminate_dead_code, is_call, is_conv, is_hw_sum
from ..glue.linears import graph_value, linear_parts, value_of

__all__ = ["se_gates", "se_scales", "FUSED_SQUEEZE"]

FUSED_SQUEEZE = 16384
"""Most values per sample (``C*H*W``) whose spatial mean the ``se_gate`` kernel computes itself,
one program streaming the sample; a larger gate gets the mean from the graph's own reduction:
a few programs streaming large samples are slow (measurements: docs/decisions.md, "The SE gate as
one Triton kernel")."""


def _spatial_mean_of(node: object) -> tuple[fx.Node, fx.Node] | None:
    """``(x, mean)`` when ``node`` is the canonical spatial mean of a 4-d ``x`` that ``normalize``
    makes of ``mean``/``adaptive_avg_pool2d(., 1)`` (and of a whole-window ``avg_pool2d`` or a
    mean of H, W flattened, ``pre_fusion.squeeze``): ``mean = mul(sum(x, [2, 3], keepdim),
    1/(H*W))`` (for a half-precision ``x`` summed in fp32 and cast back: ``mean`` is the cast),
    reshaped to ``[N, C]`` or not; else ``None``."""
    if isinstance(node, fx.Node) and (is_call(node, torch.reshape, torch.flatten) or (
            node.op == "call_method" and node.target in ("view", "reshape", "flatten"))):
        node = node.args[0]
    cast = node if dtype_cast(node) is not None else None  # a half-precision mean, from fp32
    if cast is not None:
        node = node.args[0]
    if not is_call(node, torch.mul) or len(node.args) != 2:
        return None
    mean = cast if cast is not None else node
    total, scale = node.args
    if not isinstance(scale, float):
        total, scale = scale, total
    if not isinstance(scale, float) or not is_hw_sum(total):
        return None
    x = total.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 4 \
            or abs(scale * val.shape[2] * val.shape[3] - 1.0) >= 1e-6:
        return None
    return x, mean


def _dense(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, object, object, bool] | None:
    """``(input, weight, bias, conv)`` of a fully connected layer: a linear layer (see
    :func:`~.linears.linear_parts`; ``conv`` false), or a 1x1 convolution without padding or
    groups of a ``[N, C, 1, 1]`` value, its bias the ``[1, K, 1, 1]`` operand of an ``add`` after
    it, as ``normalize`` writes a conv bias (``conv`` true; ``bias`` may be ``None``)."""
    parts = linear_parts(gm, node)
    if parts is not None:
        return (*parts, False)
    bias = None
    if is_call(node, torch.add) and len(node.args) == 2 and is_conv(node.args[0]):
        node, bias = node.args
    if not is_conv(node):
        return None
    x, w, b, _, padding, _, groups = node.args
    xv, wv, bv = value_of(gm, x), value_of(gm, w), value_of(gm, bias) if bias is not None else None
    if b is not None or groups != 1 or tuple(padding) != (0, 0) or xv is None or wv is None \
            or xv.dim() != 4 or tuple(xv.shape[2:]) != (1, 1) or tuple(wv.shape[2:]) != (1, 1) \
            or (bias is not None and (bv is None or tuple(bv.shape) != (1, wv.shape[0], 1, 1))):
        return None
    return x, w, bias, True


_ACTIVATIONS = {torch.relu: "relu", F.silu: "silu"}
_GATES = {torch.sigmoid: "sigmoid", F.hardsigmoid: "hardsigmoid"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def se_gates(gm: fx.GraphModule) -> int:
    """Rewrite, in place, each squeeze-and-excitation gate ``gate(fc2(act(fc1(mean_hw(x)))))`` into
    ``se_gate(x, W1, b1, W2, b2, act, gate)``: ``fc1``/``fc2`` linear layers (SE-ResNet9) or 1x1
    convolutions of the pooled ``[N, C, 1, 1]`` value with their bias adds (torchvision's
    ``SqueezeExcitation``, which the fuse pass leaves out of regions), ``act`` ReLU or SiLU,
    ``gate`` the sigmoid or the hard sigmoid (MobileNetV3's ``F.hardsigmoid``). The result is
    reshaped to the gate's shape (``[N, C]`` or ``[N, C, 1, 1]``), so the multiply of ``x`` by the
    gate that follows is unchanged. A gate whose samples hold more than :data:`FUSED_SQUEEZE` values
    gets the pooled ``[N, C, 1, 1]`` mean (the graph's own reduction) instead of ``x``.

    Matched when ``x`` is 4-d with known metadata, ``x`` and the gate share one floating dtype
    (fp16, bf16 or fp32) and the weights are of one of those (under ``torch.autocast`` the layers of
    fp32 weights run in the autocast dtype; the kernel reads every weight into fp32), ``W1`` is
    ``[R, C]`` and ``W2`` ``[C, R]`` (``[R, C, 1, 1]``, ``[C, R, 1, 1]`` as convolutions) with ``C``
    at most :data:`~fusion_compiler.kernels.se_gate.MAX_CHANNELS`, ``R`` at most
    :data:`~fusion_compiler.kernels.se_gate.MAX_HIDDEN` and ``R * C`` at most
    :data:`~fusion_compiler.kernels.se_gate.MAX_GATE_WEIGHT` (the kernel holds a weight in
    registers), and the gate is out-of-place (``functionalize`` makes ``inplace=True`` so before).
    Other activations are not matched. Returns how many were rewritten."""
    from ...kernels.se_gate import (MAX_CHANNELS, MAX_GATE_WEIGHT,  # noqa: PLC0415
                                    MAX_HIDDEN, se_gate)

    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if not is_call(node, *_GATES) or not isinstance(node.args[0], fx.Node) or any(
                v is not False for v in (*node.args[1:], *node.kwargs.values())):
            continue  # an inplace=True left (functionalize makes them out-of-place)
        second = _dense(gm, node.args[0])
        act = second[0] if second is not None else None
        if not is_call(act, *_ACTIVATIONS) or not isinstance(act.args[0], fx.Node):
            continue
        first = _dense(gm, act.args[0])
        squeeze = _spatial_mean_of(first[0]) if first is not None else None
        if squeeze is None or first[3] != second[3]:
            continue
        x, mean = squeeze
        (_, w1, b1, conv), (_, w2, b2, _) = first, second
        xv, w1v, w2v, out = x.meta["val"], value_of(gm, w1), value_of(gm, w2), node.meta.get("val")
        if w1v is None or w2v is None or not isinstance(out, torch.Tensor) \
                or xv.dtype not in _DTYPES or out.dtype != xv.dtype \
                or w1v.dtype not in _DTYPES or w2v.dtype not in _DTYPES:
            continue
        hidden, channels = w1v.shape[:2]
        if w1v.dim() != (4 if conv else 2) or tuple(w2v.shape[:2]) != (channels, hidden) \
                or xv.shape[1] != channels or channels > MAX_CHANNELS or hidden > MAX_HIDDEN \
                or hidden * channels > MAX_GATE_WEIGHT:
            continue
        with graph.inserting_before(node):
            w1n, b1n, w2n, b2n = (graph_value(graph, a) for a in (w1, b1, w2, b2))
            if conv:  # [K, C, 1, 1] weights and [1, K, 1, 1] biases as the op takes them
                w1n = graph.call_function(torch.reshape, (w1n, (hidden, channels)))
                w2n = graph.call_function(torch.reshape, (w2n, (channels, hidden)))
                b1n = b1n if b1n is None else graph.call_function(torch.reshape, (b1n, (hidden,)))
                b2n = b2n if b2n is None else graph.call_function(torch.reshape, (b2n, (channels,)))
            # a sample of at most FUSED_SQUEEZE values is streamed by the kernel's program; a
            # larger one is pooled by the graph's own reduction (parallel over H, W) first
            source = x if xv[0].numel() <= FUSED_SQUEEZE else mean
            kind = _GATES[node.target]  # passed only where not the default
            gate = graph.call_function(se_gate, (source, w1n, b1n, w2n, b2n,
                                                 _ACTIVATIONS[act.target],
                                                 *((kind,) if kind != "sigmoid" else ())))
            if out.dim() != 2:
                gate.meta = {"val": out.reshape(out.shape[:2])} if "val" in node.meta else {}
                gate = graph.call_function(torch.reshape, (gate, tuple(out.shape)))
        gate.meta = dict(node.meta)
        node.replace_all_uses_with(gate)
        graph.erase_node(node)
        rewritten += 1
    return _finished(gm, rewritten)


_EVERY = slice(None, None, None)


def _is_gate_view(node: fx.Node, n: int, c: int) -> bool:
    """Whether ``node`` views a ``[N, C]`` gate as ``[N, C, 1, 1]`` (a reshape, or the
    indexing ``g[:, :, None, None]``)."""
    reshape = is_call(node, torch.reshape) or (
        node.op == "call_method" and node.target in ("view", "reshape")) or (
        is_call(node, operator.getitem) and node.args[1] == (_EVERY, _EVERY, None, None))
    val = node.meta.get("val")
    return reshape and isinstance(val, torch.Tensor) and tuple(val.shape) == (n, c, 1, 1)


def _other(node: fx.Node, target: object, one: fx.Node) -> object:
    """The operand of the two-operand ``target`` call ``node`` that is not ``one`` (``None``
    when ``node`` is not such a call of ``one``, or has keyword arguments)."""
    if not is_call(node, target) or len(node.args) != 2 or node.kwargs or one not in node.args:
        return None
    a, b = node.args
    return b if a is one else a


def _same_value(node: object, like: torch.Tensor) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.shape == like.shape
            and val.dtype == like.dtype and val.stride() == like.stride())


def _residual_like(node: fx.Node, like: torch.Tensor) -> bool:
    """Whether ``node`` can be ``se_scale``'s residual for ``like``: the same shape and dtype,
    any strides (the kernel reads it with its own; a channel view of a wider tensor is one)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.shape == like.shape and val.dtype == like.dtype


def se_scales(gm: fx.GraphModule) -> int:
    """Rewrite, in place, each multiply of a ``[N, C, H, W]`` value ``x`` by its own gate
    ``se_gate(x, ...)`` reshaped to ``[N, C, 1, 1]`` (what :func:`se_gates` leaves) into
    ``se_scale(x, ..., residual, relu, bias)``, taking along what follows it when each step's
    result has no other user: ``+ residual`` (a value of ``x``'s shape and dtype), then
    ReLU, then ``+ bias`` (a one-element tensor of ``x``'s dtype), then a cast to another
    floating dtype (the autocast pass's cast of the output up to fp32: the kernel writes that
    dtype, from its fp32 values), in that order. A gate computed
    from the pooled mean (a sample of more than :data:`FUSED_SQUEEZE` values) is left alone: its
    kernel would stream large samples in one program each.

    Matched only where every step keeps ``x``'s shape, dtype and strides (the kernel's output is
    laid out as ``torch.empty_like(x)``) and ``x`` is dense. Returns how many were rewritten."""
    from ...kernels.se_gate import se_gate, se_scale  # noqa: PLC0415

    graph = gm.graph
    rewritten = 0
    for gate in list(graph.nodes):
        if not is_call(gate, se_gate) or len(gate.users) != 1:
            continue
        x = gate.args[0]
        xv = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(xv, torch.Tensor) or xv.dim() != 4 or not _dense_layout(xv):
            continue
        view = next(iter(gate.users))
        if not _is_gate_view(view, *xv.shape[:2]) or len(view.users) != 1:
            continue
        last = next(iter(view.users))
        if _other(last, torch.mul, view) is not x or not _same_value(last, xv):
            continue
        residual, relu, bias = None, False, None
        step = _single_user(last)
        if (r := _other(step, torch.add, last)) is not None and isinstance(r, fx.Node) \
                and _residual_like(r, xv) and _same_value(step, xv):
            residual, last, step = r, step, _single_user(step)
        if is_call(step, torch.relu) and len(step.args) == 1 and _same_value(step, xv):
            relu, last, step = True, step, _single_user(step)
        b = _other(step, torch.add, last)
        bv = b.meta.get("val") if isinstance(b, fx.Node) else None
        if isinstance(bv, torch.Tensor) and bv.numel() == 1 and bv.dtype == xv.dtype \
                and _same_value(step, xv):
            bias, last = b, step
        extra = tuple(gate.args[6:])
        step = _single_user(last)
        cast, sv = dtype_cast(step), step.meta.get("val") if step is not None else None
        if cast is not None and cast.is_floating_point and isinstance(sv, torch.Tensor) \
                and sv.shape == xv.shape and sv.stride() == xv.stride():
            extra, last = (extra[0] if extra else "sigmoid", cast), step  # the kernel writes it
        with graph.inserting_before(last):
            fused = graph.call_function(se_scale, (x, *gate.args[1:6], residual, relu, bias,
                                                   *extra))
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        rewritten += 1
    return _finished(gm, rewritten)


def _single_user(node: fx.Node) -> fx.Node | None:
    """The one node that uses ``node``, if exactly one does (and uses it once)."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if sum(a is node for a in (*user.args, *user.kwargs.values())) == 1 else None


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` is laid out densely (``torch.empty_like`` then keeps its strides)."""
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _finished(gm: fx.GraphModule, rewritten: int) -> int:
    """``rewritten``, after removing what the rewrites left unused and recompiling ``gm`` (when
    there were any)."""
    if rewritten:
        eliminate_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return rewritten
