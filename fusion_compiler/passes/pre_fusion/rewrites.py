"""Exact rewrites of a data-movement or pooling op in front of a 1x1 convolution, so that the pair
lowers to cuDNN well.

* :func:`space_to_depth_conv` -- SpaceToDepth(b) followed by a 1x1 convolution equals a b x b,
  stride-b convolution with the weight rearranged (a change of summation order only). That form
  is used when the image's channel count needs no padding for cuDNN; otherwise (the 3-channel RGB
  and 11-channel depth stems) the SpaceToDepth becomes one copy straight to channels_last and
  the 1x1 convolution stays, on ``b*b*C`` channels that need no padding. In CUDA inference where
  Triton runs, such a region then absorbs the copy (the fusion pass
  :mod:`fusion_compiler.passes.fusion.space_to_depth_stem`, which finds it with
  :func:`space_to_depth_source`) and runs as one Triton kernel (the ``triton_stem`` backend,
  :mod:`fusion_compiler.backends.triton_stem`).
* :func:`strided_stem_conv` -- a convolution of a few-channel image whose kernel equals its
  stride (a patchify stem: ConvNeXt's 4x4 stride 4) equals a 1x1 convolution of the image's
  space-to-depth copy, with the weight rearranged the same way; cuDNN runs the second form on
  ``s*s*C`` channels far faster than the first on 4 or 8.
* :func:`avgpool_conv` -- ``AvgPool2d(k, s, p, count_include_pad=True)`` followed by a 1x1
  convolution, or following one (DenseNet's transition), equals a k x k, stride-s, pad-p
  convolution whose every tap is ``weight / k**2`` (both are linear; the pool's divisor is always
  ``k**2`` when padding counts).

Weights are rearranged by graph ops on the live parameter, so gradients flow and the result stays
right after ``load_state_dict``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import (CONV, avg_pool2d_args, eliminate_dead_code, int_pair, is_call, is_conv,
                       tensor_shape)

__all__ = ["space_to_depth_conv", "strided_stem_conv", "avgpool_conv", "space_to_depth_source",
           "pointwise_conv"]


def pointwise_conv(node: fx.Node) -> bool:
    """A plain 1x1 convolution: stride 1, no padding, no dilation, no groups."""
    if not is_conv(node):
        return False
    w = tensor_shape(node.args[1])
    return (w is not None and w[2:] == (1, 1) and tuple(node.args[3]) == (1, 1)
            and tuple(node.args[4]) == (0, 0) and tuple(node.args[5]) == (1, 1) and node.args[6] == 1)


def _is_reshape(node: object) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target in ("view", "reshape")) or is_call(node, torch.reshape))


def _permutation(node: object) -> tuple[int, ...] | None:
    if isinstance(node, fx.Node) and (
            (node.op == "call_method" and node.target == "permute") or is_call(node, torch.permute)):
        dims = node.args[1:] if node.op == "call_method" else node.args[1:2]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        return tuple(dims)
    return None


#: Channel multiple a convolution input needs on cuDNN's NHWC engines without zero padding (8 for
#: fp16/bf16, docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"; 4 would do for fp32, 8
#: serves both).
CHANNEL_MULTIPLE = 8


def _nhwc_space_to_depth(g: fx.Graph, split: fx.Node, rows: int, cols: int,
                         channels: int, b: int, batch: int = -1) -> fx.Node:
    """The channels_last copy of SpaceToDepth(``b``) from ``split``, an image viewed as
    ``[N, channels, rows, b, cols, b]``: ``permute(0,2,4,3,5,1)``, ``reshape(batch, rows, cols,
    b*b*channels)``, ``permute(0,3,1,2)`` (the form :func:`space_to_depth_source` finds)."""
    nhwc = g.call_function(torch.permute, (split, (0, 2, 4, 3, 5, 1)))
    flat = g.call_function(torch.reshape, (nhwc, (batch, rows, cols, b * b * channels)))
    return g.call_function(torch.permute, (flat, (0, 3, 1, 2)))


def _replaced(g: fx.Graph, conv: fx.Node, new: fx.Node) -> None:
    """``new`` (same value) takes over ``conv``'s metadata and users; ``conv`` is erased."""
    new.meta.update(conv.meta)
    conv.replace_all_uses_with(new)
    g.erase_node(conv)


def _finished(gm: fx.GraphModule, changed: bool) -> fx.GraphModule:
    """``gm`` after removing what the rewrites left unused, checked and recompiled (as it was
    when nothing ``changed``: a recompile costs about 3 ms)."""
    if changed:
        eliminate_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return gm


def space_to_depth_conv(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``conv1x1(SpaceToDepth_b(x), w)`` for cuDNN.

    SpaceToDepth is matched as
    ``x.view(N,C,H/b,b,W/b,b).permute(0,3,5,1,2,4).reshape(N,b*b*C,H/b,W/b)``,
    i.e. ``out[(dh*b+dw)*C + c, hb, wb] = x[c, b*hb+dh, b*wb+dw]``.

    * ``C`` a multiple of :data:`CHANNEL_MULTIPLE`: ``conv(x, w', stride=b)`` with
      ``w'[k, c, dh, dw] = w[k, (dh*b+dw)*C + c]`` (``w.reshape(K,b,b,C).permute(0,3,1,2)``), no
      copy.
    * otherwise: the same values written in one copy straight to channels_last,
      ``x.view(N,C,H/b,b,W/b,b).permute(0,2,4,3,5,1).reshape(N,H/b,W/b,b*b*C).permute(0,3,1,2)``
      (an ``[N, b*b*C, H/b, W/b]`` tensor with NHWC strides), and the 1x1 convolution is kept.
      The folded form would make cuDNN zero-pad the image to 4 or 8 channels and run a strided
      conv on it, slower than the copy and the 1x1 convolution together (docs/decisions.md,
      "The ``space_to_depth`` and ``avgpool_conv`` rewrites and why CPU inputs skip them").
    """
    g = gm.graph
    changed = False
    for conv in list(g.nodes):
        if not pointwise_conv(conv) or not _is_reshape(conv.args[0]):
            continue
        folded = conv.args[0]
        perm = folded.args[0]
        if _permutation(perm) != (0, 3, 5, 1, 2, 4) or not _is_reshape(perm.args[0]):
            continue
        split = perm.args[0]
        x = split.args[0]
        xs, ss, fs = tensor_shape(x), tensor_shape(split), tensor_shape(folded)
        if xs is None or ss is None or fs is None or len(xs) != 4:
            continue
        n, c, h, w = xs
        b = ss[3]
        if ss != (n, c, h // b, b, w // b, b) or ss[5] != b or fs != (n, b * b * c, h // b, w // b):
            continue
        if c % CHANNEL_MULTIPLE:
            with g.inserting_before(conv):
                image = _nhwc_space_to_depth(g, split, h // b, w // b, c, b, batch=n)
            conv.replace_input_with(folded, image)
            changed = True
            continue
        k = tensor_shape(conv.args[1])[0]
        with g.inserting_before(conv):
            wr = g.call_function(torch.reshape, (conv.args[1], (k, b, b, c)))
            wp = g.call_function(torch.permute, (wr, (0, 3, 1, 2)))
            new = g.call_function(CONV, (x, wp, None, (b, b), (0, 0), (1, 1), 1))
        _replaced(g, conv, new)
        changed = True
    return _finished(gm, changed)


def space_to_depth_source(node: object) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``(x, b, chain)`` when ``node`` is SpaceToDepth(b) of ``x`` in either form this module
    knows, else ``None``; ``chain`` lists the nodes from ``x`` to ``node`` (``x`` excluded).

    * the model's own: ``x.view(N,C,H/b,b,W/b,b).permute(0,3,5,1,2,4).reshape(N,b*b*C,H/b,W/b)``;
    * :func:`space_to_depth_conv`'s copy to channels_last:
      ``permute(reshape(permute(x.view(N,C,H/b,b,W/b,b), (0,2,4,3,5,1)), (N,H/b,W/b,b*b*C)),
      (0,3,1,2))``.

    Both are ``out[n, (dh*b+dw)*C + c, hb, wb] = x[n, c, b*hb+dh, b*wb+dw]``; shapes are read
    from ``meta["val"]``.
    """
    if _permutation(node) == (0, 3, 1, 2) and _is_reshape(node.args[0]):  # the NHWC copy
        flat = node.args[0]
        perm = flat.args[0]
        if _permutation(perm) != (0, 2, 4, 3, 5, 1):
            return None
        head = [perm, flat, node]
    elif _is_reshape(node) and _permutation(node.args[0]) == (0, 3, 5, 1, 2, 4):
        perm = node.args[0]
        head = [perm, node]
    else:
        return None
    split = perm.args[0]
    if not _is_reshape(split) or not isinstance(split.args[0], fx.Node):
        return None
    x = split.args[0]
    xs, ss, out = tensor_shape(x), tensor_shape(split), tensor_shape(node)
    if xs is None or ss is None or out is None or len(xs) != 4 or len(ss) != 6:
        return None
    n, c, h, w = xs
    b = ss[3]
    if b < 1 or ss != (n, c, h // b, b, w // b, b) or out != (n, b * b * c, h // b, w // b):
        return None
    return x, b, [split, *head]


def strided_stem_conv(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``conv(x, w, b, stride=s, padding=p)`` of an image ``x`` with ``C`` at most 4
    channels (a stem) whose ``s x s`` kernel equals its stride ``s >= 2`` (a patchify stem, such
    as ConvNeXt's 4x4 stride 4) as a 1x1 convolution of ``x``'s space-to-depth copy:

    * image: ``x`` zero-padded by ``p`` at the top and left and to ``s*H_out`` rows and
      ``s*W_out`` columns (a negative pad crops rows no output reads), with zero channels up to
      ``C'`` (the fewest that make ``s*s*C'`` a multiple of 8, cuDNN's half-precision channel
      multiple), copied straight to channels_last as SpaceToDepth(s):
      ``img[n, (dh*s + dw)*C' + c, i, j] = x_pad[n, c, s*i + dh, s*j + dw]``;
    * weight: ``w`` zero-padded to ``C'`` channels, rearranged the same way:
      ``w'[o, (dh*s + dw)*C' + c] = w_pad[o, c, dh, dw]``;
    * ``conv(img, w', b)``: each output sums the same products as before, plus zeros (a change of
      summation order only).

    cuDNN runs the 1x1 form as a GEMM on ``s*s*C'`` channels; the strided form, on an image padded
    to 4 or 8 channels, ran 2-3 times slower. Larger kernels (the 7x7 stride-2 ResNet stem as a 4x4
    convolution on 16 channels) ran slower than PyTorch's convolution on 4 channels, and are left
    (measurements: docs/decisions.md, "cuDNN stems on 4 channels; patchify stems as
    space-to-depth"); a smaller kernel reads only part of the image, which the copy would hold
    whole. Matched only without groups or dilation, where ``C`` is not a multiple of 8 already
    and the zero channels add at most a third (``3 * C' <= 4 * C``: not for an odd stride, whose
    ``s * s * C'`` needs ``C' = 8``). Weights are rearranged by graph ops on the live parameter
    (hoisted in inference)."""
    g = gm.graph
    changed = False
    for conv in list(g.nodes):
        if not is_conv(conv) or len(conv.args) != 7 or conv.kwargs or conv.args[6] != 1:
            continue
        x, w = conv.args[0], conv.args[1]
        xs, ws, ys = tensor_shape(x), tensor_shape(w), tensor_shape(conv)
        stride, padding, dilation = (int_pair(a) for a in conv.args[3:6])
        if xs is None or ws is None or ys is None or len(xs) != 4 or None in (stride, padding) \
                or dilation != (1, 1) or stride[0] != stride[1] or stride[0] < 2:
            continue
        _, c, h, wd = xs
        if not all(isinstance(v, int) for v in (c, h, wd, *ws)):
            continue  # symbolic sizes: the pads below would bake one in
        s, (kh, kw) = stride[0], ws[2:]
        channels = c
        while (s * s * channels) % 8:
            channels += 1
        if c > 4 or c % 8 == 0 or (kh, kw) != (s, s) or 3 * channels > 4 * c:
            continue  # a smaller kernel reads part of the image; the copy would hold all of it
        rows, cols = ys[2], ys[3]  # one block of s x s pixels per output
        pad = (padding[1], s * cols - wd - padding[1], padding[0], s * rows - h - padding[0],
               0, channels - c)
        k = ws[0]
        with g.inserting_before(conv):
            xp = g.call_function(F.pad, (x, pad)) if any(pad) else x
            split = g.call_function(torch.reshape, (xp, (-1, channels, rows, s, cols, s)))
            image = _nhwc_space_to_depth(g, split, rows, cols, channels, s)
            wp = g.call_function(F.pad, (w, (0, 0, 0, 0, 0, channels - c))) \
                if channels > c else w
            wperm = g.call_function(torch.permute, (wp, (0, 2, 3, 1)))  # [K, dh, dw, C']
            weight = g.call_function(torch.reshape, (wperm, (k, s * s * channels, 1, 1)))
            new = g.call_function(CONV, (image, weight, conv.args[2], (1, 1), (0, 0), (1, 1), 1))
        _replaced(g, conv, new)
        changed = True
    return _finished(gm, changed)


def avgpool_conv(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``conv1x1(avg_pool2d(a, k, s, p, count_include_pad=True), w)``, and
    ``avg_pool2d(conv1x1(a, w), k, s, p, count_include_pad=True)`` where the pool is the
    convolution's only reader (DenseNet's transition), as
    ``conv(a, broadcast(w * (1 / k**2)) to [K, C, k, k], stride=s, padding=p)``. Both are linear,
    so the result differs from eager's only in rounding: the order of the sums, and the weight's
    scale where ``k**2`` is not a power of two (exact for DenseNet's 2x2 pool). In the second form
    the padding the pool adds is zeros of the convolution's output, which the new convolution's
    zero padding of ``a`` gives (a convolution node has no bias after ``normalize``); it has the
    FLOPs of the 1x1 convolution, and the full-size output is not written and read again.

    Only ``ceil_mode=False`` and no ``divisor_override`` pools match: otherwise the divisor varies.
    Any float dtype; shapes need metadata (``meta["val"]``). Raises nothing.
    """
    g = gm.graph
    changed = False
    for node in list(g.nodes):
        if pointwise_conv(node) and is_call(node.args[0], F.avg_pool2d):
            conv, pool = node, node.args[0]
        elif is_call(node, F.avg_pool2d) and pointwise_conv(node.args[0]) \
                and len(node.args[0].users) == 1:
            conv, pool = node.args[0], node
        else:
            continue
        a = avg_pool2d_args(pool)
        pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
        kh, kw = pair(a["kernel_size"])
        stride = pair(a["stride"] if a["stride"] not in (None, [], ()) else a["kernel_size"])
        if a["ceil_mode"] or not a["count_include_pad"] or a["divisor_override"] is not None:
            continue
        wshape = tensor_shape(conv.args[1])
        image = a["input"] if node is conv else conv.args[0]
        with g.inserting_before(node):
            scaled = g.call_function(torch.mul, (conv.args[1], 1.0 / (kh * kw)))
            taps = g.call_method("expand", (scaled, (wshape[0], wshape[1], kh, kw)))
            new = g.call_function(CONV, (image, taps, None, stride, pair(a["padding"]),
                                         (1, 1), 1))
        _replaced(g, node, new)
        changed = True
    return _finished(gm, changed)
