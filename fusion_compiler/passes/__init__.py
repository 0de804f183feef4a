"""Graph passes, each a documented ``GraphModule -> GraphModule`` function, and the default order.

=================  ==========================================================================
pass               rewrites
=================  ==========================================================================
normalize          in-place -> out-of-place (SSA), modules -> functions, conv bias -> add
fold_bn            eval batch norm after a conv -> per-channel scale + bias
space_to_depth     SpaceToDepth(b) + 1x1 conv -> b x b stride-b conv, or (image channels
                   cuDNN would pad) one channels_last SpaceToDepth copy + the 1x1 conv
avgpool_conv       AvgPool2d(k, s, p, count_include_pad) + 1x1 conv -> k x k stride-s conv
fuse               conv chains -> Region submodules (prologue, epilogue, exit reduction)
verify             checks SSA, beta = 0, one conv per region, no aliasing (raises FusionError)
=================  ==========================================================================
"""

import functools

from .fold_bn import fold_batch_norm
from .fuse import fuse_regions
from .manager import Pass, PassManager
from .normalize import normalize
from .rewrites import avgpool_conv, space_to_depth_conv
from .verify import verify

__all__ = ["Pass", "PassManager", "default_passes", "normalize", "fold_batch_norm",
           "space_to_depth_conv", "avgpool_conv", "fuse_regions", "verify"]


def default_passes(fuse_prologue: bool = False, fuse_reduction: bool = False) -> list[Pass]:
    """The pipeline ``compile()`` runs, in order.

    ``fuse_prologue`` / ``fuse_reduction`` let the fuse pass absorb pointwise ops on a conv's input
    and the exit H, W sum. Both are off by default because on an H100 (cuDNN 9.19) the fused
    kernels were slower than the unfused pair, in CUDA-graph timings of every ranked plan
    (fp16, NHWC, N=128): a scalar-add prologue took a 64->64 3x3 conv at 16x16 from 9.3 us to
    21.8 us (a separate add costs 2.7 us) and a 512->512 conv at 2x2 from 12.8 to 58.5 us (add:
    1.6 us); the fused H, W sum took 18.7 us against 9.3 + 5.8 us unfused at 16x16.
    """
    return [
        Pass("normalize", normalize),
        Pass("fold_bn", fold_batch_norm),
        Pass("space_to_depth", space_to_depth_conv),
        Pass("avgpool_conv", avgpool_conv),
        Pass("fuse", functools.partial(fuse_regions, prologue=fuse_prologue,
                                       reduction=fuse_reduction)),
        Pass("verify", verify),
    ]
