"""Graph passes, each a documented ``GraphModule -> GraphModule`` function, and the default order.

=================  ==========================================================================
pass               rewrites
=================  ==========================================================================
normalize          in-place -> out-of-place (SSA), modules -> functions, conv bias -> add
fold_bn            eval batch norm after a conv -> per-channel scale + bias
space_to_depth     SpaceToDepth(b) + 1x1 conv -> b x b stride-b conv, or (image channels
                   cuDNN would pad) one channels_last SpaceToDepth copy + the 1x1 conv
avgpool_conv       AvgPool2d(k, s, p, count_include_pad) + 1x1 conv -> k x k stride-s conv
fuse               conv chains -> Region submodules (prologue, epilogue, exit reduction;
                   with ``concurrent_branches``, a join of two branches left to the longer one)
verify             checks SSA, beta = 0, one conv per region, no aliasing (raises FusionError)
=================  ==========================================================================
"""

import functools

from .pre_fusion.fold_bn import fold_batch_norm
from .fusion.fuse import fuse_regions
from .manager import Pass, PassManager
from .pre_fusion.normalize import normalize
from .pre_fusion.rewrites import avgpool_conv, space_to_depth_conv
from .fusion.verify import verify

__all__ = ["Pass", "PassManager", "default_passes", "normalize", "fold_batch_norm",
           "space_to_depth_conv", "avgpool_conv", "fuse_regions", "verify"]


def default_passes(fuse_prologue: bool = False, fuse_reduction: bool = False,
                   cuda: bool = True, concurrent_branches: bool = False) -> list[Pass]:
    """The pipeline ``compile()`` runs, in order.

    ``cuda=False`` (inputs on another device, where every region runs on PyTorch ops) leaves out
    the two rewrites that exist for cuDNN: ``space_to_depth`` (an NHWC image copy or a 4x4/s4
    conv) and ``avgpool_conv`` (a pool folded into a k x k conv, k^2 times the FLOPs). On a 2-core
    CPU with torch 2.13, SE-ResNet9 at N=2 took 22.2 ms a call compiled with them and 8.0 ms
    without (eager 7.7-8.1 ms): the NHWC image turned every later mkldnn convolution
    channels_last (13.4 ms without ``avgpool_conv`` alone, 16.3 ms without ``space_to_depth``
    alone).

    ``fuse_prologue`` / ``fuse_reduction`` let the fuse pass absorb pointwise ops on a conv's input
    and the exit H, W sum. Both are off by default because on an H100 (cuDNN 9.19) the fused
    kernels were slower than the unfused pair, in CUDA-graph timings of every ranked plan
    (fp16, NHWC, N=128): a scalar-add prologue took a 64->64 3x3 conv at 16x16 from 9.3 us to
    21.8 us (a separate add costs 2.7 us) and a 512->512 conv at 2x2 from 12.8 to 58.5 us (add:
    1.6 us); the fused H, W sum took 18.7 us against 9.3 + 5.8 us unfused at 16x16.

    ``concurrent_branches`` makes the fuse pass leave a join of two branches out of the shorter
    branch's region (``fuse_regions(branches=True)``), so that region can run on a second stream
    (:mod:`fusion_compiler.runtime.streams`); ``compile(concurrent_branches=True)`` sets it for
    CUDA inference in a CUDA graph.
    """
    cudnn_layout = [Pass("space_to_depth", space_to_depth_conv),
                    Pass("avgpool_conv", avgpool_conv)] if cuda else []
    return [
        Pass("normalize", normalize),
        Pass("fold_bn", fold_batch_norm),
        *cudnn_layout,
        Pass("fuse", functools.partial(fuse_regions, prologue=fuse_prologue,
                                       reduction=fuse_reduction, branches=concurrent_branches)),
        Pass("verify", verify),
    ]
