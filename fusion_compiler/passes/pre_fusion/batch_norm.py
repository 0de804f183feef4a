"""Train-mode batch norm with a cumulative moving average (``nn.BatchNorm2d(momentum=None)``)
as ops a tracer can follow.

``nn.BatchNorm2d.forward`` computes that average's factor as ``1.0 / float(num_batches_tracked)``:
a Python float read from a tensor, which ``make_fx`` (AOTAutograd, under Inductor's compile of the
glue) cannot trace ("Could not guard on data-dependent expression"). :func:`cumulative_batch_norm`
computes the same update with the factor kept as a tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cumulative_batch_norm"]


def cumulative_batch_norm(x: torch.Tensor, running_mean: torch.Tensor,
                          running_var: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, num_batches_tracked: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """``nn.BatchNorm2d(momentum=None)`` in train mode: ``x`` (N, C, H, W) normalized by its batch
    statistics; ``num_batches_tracked`` (int64, 0-d) incremented, and the running statistics (C,)
    moved to the cumulative average ``running = batch / n + running * (1 - 1 / n)``, ``n`` the
    incremented count, the batch variance unbiased (the rule of ``torch.nn.BatchNorm2d``'s
    documentation, "momentum=None"), in place.

    The batch statistics come from the batch norm kernel itself (momentum 1 into fresh buffers
    gives them exactly, rounded to the buffers' dtype); the average is taken in at least fp32, in
    ATen's form ``batch * f + running * (1 - f)``, and written in the buffers' dtype. Against the
    module: the same to rounding in fp32 and fp64; in fp16 and bf16 the batch statistics are
    rounded once more before the average (the module averages them in fp32).
    Returns the normalized tensor, of ``x``'s shape and dtype.
    """
    num_batches_tracked.add_(1)
    batch_mean = torch.zeros_like(running_mean)
    batch_var = torch.ones_like(running_var)
    out = F.batch_norm(x, batch_mean, batch_var, weight, bias, True, 1.0, eps)
    wide = torch.promote_types(running_mean.dtype, torch.float32)
    factor = num_batches_tracked.to(wide).reciprocal()
    keep = 1 - factor  # ATen's update: batch * f + running * (1 - f)
    running_mean.copy_(batch_mean.to(wide) * factor + running_mean.to(wide) * keep)
    running_var.copy_(batch_var.to(wide) * factor + running_var.to(wide) * keep)
    return out
