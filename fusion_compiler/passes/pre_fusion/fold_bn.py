"""fold_bn: eval-mode batch norm after a convolution becomes a per-channel scale + bias epilogue.

``F.batch_norm(y, mean, var, gamma, beta, training=False, eps=eps)`` with ``y`` produced by a
convolution (optionally through its bias add) is rewritten as ::

    scale = gamma * rsqrt(var + eps)             # [K]
    shift = beta - mean * scale                  # [K]
    out   = y * scale.reshape(1, K, 1, 1) + shift.reshape(1, K, 1, 1)

(Ioffe & Szegedy 2015, eq. for inference; the scale/shift form is what cuDNN's fused
"ConvBiasAct"/generic-fusion epilogues take as ``[1,K,1,1]`` operands). ``scale`` and ``shift`` are
computed from the live parameters and buffers on every call, so the compiled module stays right
after ``load_state_dict`` and gradients still reach ``gamma`` and ``beta``. The ``mul``/``add`` pair
is then absorbed by the fuse pass.

Half-precision (fp16, bf16) statistics and affine parameters are read in fp32 (``.to(float32)``),
``scale`` and ``shift`` computed there and rounded once each to the input's dtype where it is half
(else the statistics'), as eager batch norm computes in fp32 and returns the input's dtype (fp16
activations with fp32 statistics gave fp32 before, and a following fp16 convolution raised:
found by a review, session 42). Folded by fp16 ops, each of the five roundings on the way (``eps``
itself lost in ``var + eps`` when ``var`` is near 1) doubled the error of the batch norm's output
against fp64 (docs/decisions.md, "Batch-norm folding in fp32").

Training-mode batch norm (batch statistics) is left to PyTorch.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import is_call, is_conv

__all__ = ["fold_batch_norm"]


def _after_conv(node: object) -> bool:
    """``node`` is a convolution, or a convolution's bias ``add``."""
    return is_conv(node) or (is_call(node, torch.add) and is_conv(node.args[0]))


def _half_dtype(node: object) -> torch.dtype | None:
    """``node``'s dtype when it is fp16 or bf16 (recorded in ``meta["val"]``), else ``None``."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    dtype = getattr(val, "dtype", None)
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _in_fp32(g: fx.Graph, node: object, half: torch.dtype | None) -> object:
    """``node`` read in fp32 when the fold is rounded to a half dtype (``half``) and ``node`` is
    half precision itself, else ``node``."""
    if half is None or _half_dtype(node) is None:
        return node
    return g.call_method("to", (node, torch.float32))


def fold_batch_norm(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every eval-mode ``F.batch_norm`` that follows a convolution (see module doc)."""
    g = gm.graph
    for node in list(g.nodes):
        if not is_call(node, F.batch_norm):
            continue
        names = ["input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
                 "eps"]
        a = dict(zip(names, node.args)) | dict(node.kwargs)
        if a.get("training", False) or a.get("running_mean") is None or not _after_conv(a["input"]):
            continue
        eps = a.get("eps", 1e-5)
        # the output's dtype is the input's, as eager's: fp16 activations with fp32 statistics
        # (mixed precision kept by hand) give fp16, computed in fp32
        half = _half_dtype(a["input"]) or _half_dtype(a["running_var"])
        with g.inserting_before(node):
            var, mean, weight, bias = (_in_fp32(g, a.get(k), half) for k in (
                "running_var", "running_mean", "weight", "bias"))
            inv_std = g.call_function(torch.rsqrt, (g.call_function(torch.add, (var, eps)),))
            scale = inv_std if weight is None else g.call_function(torch.mul, (weight, inv_std))
            shift = g.call_function(torch.neg, (g.call_function(torch.mul, (mean, scale)),))
            if bias is not None:
                shift = g.call_function(torch.add, (bias, shift))
            if half is not None:  # rounded once each
                scale = g.call_method("to", (scale, half))
                shift = g.call_method("to", (shift, half))
            scale4 = g.call_function(torch.reshape, (scale, (1, -1, 1, 1)))
            shift4 = g.call_function(torch.reshape, (shift, (1, -1, 1, 1)))
            scaled = g.call_function(torch.mul, (a["input"], scale4))
            out = g.call_function(torch.add, (scaled, shift4))
        node.replace_all_uses_with(out)
        g.erase_node(node)
    g.lint()
    gm.recompile()
    return gm
