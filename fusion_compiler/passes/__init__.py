"""Graph passes, each a documented ``GraphModule -> GraphModule`` function, and the default order.

=================  ==========================================================================
pass               rewrites
=================  ==========================================================================
normalize          in-place -> out-of-place (SSA), modules -> functions, conv bias -> add
fold_bn            eval batch norm after a conv -> per-channel scale + bias
space_to_depth     SpaceToDepth(b) + 1x1 conv -> b x b stride-b conv
avgpool_conv       AvgPool2d(k, s, p, count_include_pad) + 1x1 conv -> k x k stride-s conv
fuse               conv chains -> Region submodules (prologue, epilogue, exit reduction)
verify             checks SSA, beta = 0, one conv per region, no aliasing (raises FusionError)
=================  ==========================================================================
"""

from .fold_bn import fold_batch_norm
from .fuse import fuse_regions
from .manager import Pass, PassManager
from .normalize import normalize
from .rewrites import avgpool_conv, space_to_depth_conv
from .verify import verify

__all__ = ["Pass", "PassManager", "default_passes", "normalize", "fold_batch_norm",
           "space_to_depth_conv", "avgpool_conv", "fuse_regions", "verify"]


def default_passes() -> list[Pass]:
    """The pipeline ``compile()`` runs, in order."""
    return [
        Pass("normalize", normalize),
        Pass("fold_bn", fold_batch_norm),
        Pass("space_to_depth", space_to_depth_conv),
        Pass("avgpool_conv", avgpool_conv),
        Pass("fuse", fuse_regions),
        Pass("verify", verify),
    ]
