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


def fold_batch_norm(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every eval-mode ``F.batch_norm`` that follows a convolution (see module doc)."""
    g = gm.graph
    for node in list(g.nodes):
        if not is_call(node, F.batch_norm):
            continue
        names = ["input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"]
        a = dict(zip(names, node.args)) | dict(node.kwargs)
        if a.get("training", False) or a.get("running_mean") is None or not _after_conv(a["input"]):
            continue
        eps = a.get("eps", 1e-5)
        with g.inserting_before(node):
            inv_std = g.call_function(torch.rsqrt, (g.call_function(torch.add, (a["running_var"], eps)),))
            scale = inv_std if a.get("weight") is None else g.call_function(torch.mul, (a["weight"], inv_std))
            shift = g.call_function(torch.neg, (g.call_function(torch.mul, (a["running_mean"], scale)),))
            if a.get("bias") is not None:
                shift = g.call_function(torch.add, (a["bias"], shift))
            scale4 = g.call_function(torch.reshape, (scale, (1, -1, 1, 1)))
            shift4 = g.call_function(torch.reshape, (shift, (1, -1, 1, 1)))
            out = g.call_function(torch.add, (g.call_function(torch.mul, (a["input"], scale4)), shift4))
        node.replace_all_uses_with(out)
        g.erase_node(node)
    g.lint()
    gm.recompile()
    return gm
