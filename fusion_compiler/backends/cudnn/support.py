"""Which regions the cuDNN backend takes (with the reason for each it declines), and when it
declines one after all: a rule for region kinds known to run slowly when nothing is timed, and
the timing of its kernel against the region's own PyTorch ops."""

from __future__ import annotations

import torch

from ...ir.errors import UnsupportedError
from ...ir.ops import node_device
from ...ir.region import Region
from ..base import Support
from ..glue_stand_in import pytorch_stand_in, pytorch_timing_record, timed_as
from ..timing import PYTORCH_MARGIN, paired_time_ms, sample_inputs
from .graph import import_cudnn, output_padding
from .kernel import CudnnKernel

__all__ = ["cudnn_support", "known_slow_on_cudnn", "slower_than_pytorch"]


def cudnn_support(region: Region) -> Support:
    """Whether the cuDNN backend takes ``region``, and why not: the frontend must import, CUDA
    must be available, every input must be on a CUDA device, the dtype fp16, bf16 or fp32, the
    output channels a multiple of 8 (4 for fp32) or paddable, and no SpaceToDepth prologue."""
    if region.space_to_depth:
        return Support(False, "a SpaceToDepth prologue is not a cuDNN graph op (the Triton "
                              "stem kernel runs it)")
    try:
        import_cudnn()
    except UnsupportedError as exc:
        return Support(False, exc.reason)
    if not torch.cuda.is_available():
        return Support(False, "CUDA is not available on this machine")
    for ph in region.graph_module.graph.find_nodes(op="placeholder"):
        device = node_device(ph)
        if device.type != "cuda":
            return Support(False, f"input {ph.name} is on {device}; cuDNN runs CUDA tensors")
    dtype = region.conv.args[0].meta["val"].dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return Support(False, f"dtype {dtype} is not fused (fp16, bf16 and fp32 are)")
    k = region.conv.meta["val"].shape[1]
    multiple = 4 if dtype == torch.float32 else 8
    if k % multiple and output_padding(region) is None:
        return Support(False, f"{k} output channels is not a multiple of {multiple}, which "
                              f"cuDNN's NHWC {dtype} engines need, and they cannot be padded "
                              f"({_no_padding_reason(region)})")
    return Support(True)


def known_slow_on_cudnn(region: Region) -> str:
    """Why ``region`` stays on PyTorch ops when nothing is timed (``autotune <= 1``), or ``""``.

    A static rule for region kinds that cuDNN's runtime-fusion engines ran much slower than
    PyTorch; with ``autotune > 1`` timing decides instead. One kind so far: depthwise
    convolutions of 7x7 taps or more (measurements: docs/decisions.md, "``known_slow_on_cudnn``:
    depthwise 7×7 convolutions"). resnet's 7x7 stem on zero-padded input channels was also slower
    in every timed plan (:func:`slower_than_pytorch`) but is left to cuDNN here: it is one region,
    and the GPU tests run it on cuDNN to check its gradients.
    """
    conv = region.conv
    x, w = conv.args[0].meta["val"], conv.args[1].meta["val"]
    kh, kw = w.shape[2], w.shape[3]
    if kh * kw < 49:
        return ""
    channels, groups = x.shape[1], conv.args[6]
    if groups > 1 and groups == channels:
        return (f"a depthwise {kh}x{kw} convolution: cuDNN's runtime-fusion engines ran these "
                f"far slower than PyTorch (docs/decisions.md); with autotune > 1 timing decides")
    return ""


def _no_padding_reason(region: Region) -> str:
    """Why :func:`.graph.output_padding` declines ``region`` (it returned ``None``)."""
    conv = region.conv
    if conv.args[6] != 1:
        return f"a grouped convolution ({conv.args[6]} groups)"
    if conv.args[1].op != "placeholder":
        return "the weight is computed in the region"
    return "an operand is read both before and after the convolution"


def slower_than_pytorch(region: Region, kernel: CudnnKernel) -> tuple[str, dict[str, float]]:
    """Time ``kernel`` (input preparation included) against the region's PyTorch ops as the glue
    will run them (:func:`~fusion_compiler.backends.glue_stand_in.pytorch_stand_in`): a reason
    when PyTorch is at least 10% faster (else ``""``) and the times, ms per call by backend
    (``{"cudnn": ..., "reference": ...}``).

    A 7x7 stride-2 conv on 3 channels zero-padded to 8 or 4 (the resnet stem, where the pass
    ``strided_stem`` does not rewrite it), for one, runs slower on cuDNN's runtime-fusion engines
    than PyTorch's conv + pointwise ops (measurements:
    docs/decisions.md, "Regions timed against PyTorch ops with a 10% margin").
    """
    inputs = sample_inputs(region)

    def measure() -> tuple[float, float]:
        # Paired (replays alternating), so drift during the measurement affects both alike;
        # timed one after the other, the same region's verdict changed from run to run
        # (measurements: docs/decisions.md, "Regions timed against PyTorch ops with a 10% margin").
        pytorch = pytorch_stand_in(region)
        fused, torch_ = paired_time_ms([lambda: kernel(*inputs),
                                        lambda: pytorch(*inputs)], reps=5)
        return fused, torch_

    fused_ms, torch_ms = kernel.plan.timed_against_pytorch(measure, pytorch_timing_record())
    timing = {"cudnn": fused_ms, "reference": torch_ms}
    if torch_ms < PYTORCH_MARGIN * fused_ms:
        return (f"PyTorch ops were faster on this GPU: {torch_ms:.4f} ms ({timed_as()}) against "
                f"{fused_ms:.4f} ms on cuDNN (best timed plan, input preparation included)",
                timing)
    return "", timing
