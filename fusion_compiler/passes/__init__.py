"""Graph passes, each a documented ``GraphModule -> GraphModule`` function, in four named
pipelines that one :class:`PassManager` runs (``fusion-compiler dump --stage NAME`` shows the
graph after any pass by its name). In order, with the condition under which each runs:

* **pre_fusion**: ``normalize`` (in-place -> out-of-place, i.e. SSA; modules -> functions; conv bias
  -> add; arithmetic written one way: operand order, ``alpha``, negations, broadcasts,
  ``clamp(x, min=0)`` as ReLU where nothing is differentiated), ``identities`` (eval-mode dropout
  and torchvision's stochastic depth, which return their input, removed), ``canonical_views``
  (``unsqueeze``/``squeeze``, indexing by ``None`` and chained size-1 reshapes as one
  ``torch.reshape``), ``cse`` (repeated reads and pure calls merged: equivalent spellings, one
  graph), ``fold_bn`` (eval batch norm after a conv -> per-channel scale + bias),
  ``space_to_depth``, ``strided_stem`` and ``avgpool_conv`` (CUDA: SpaceToDepth(b) + 1x1 conv -> a
  b x b stride-b conv or one channels_last copy; a conv of a 1-4 channel image whose kernel equals
  its stride -> a 1x1 conv of its space-to-depth copy; AvgPool2d(k, s, p) + 1x1 conv, or a 1x1 conv
  + AvgPool2d (DenseNet's transition) -> a k x k stride-s conv), ``horizontal_fusion`` (CUDA
  inference, with that option, on by default: sibling convolutions of one image -> one convolution
  and channel views of its output), ``autocast`` (under ``torch.autocast``: its casts made graph
  ops), then the user's own passes (option ``passes``, :func:`custom_passes`).
* **fusion**: ``fuse`` (conv chains -> Region submodules: prologue, epilogue, exit reduction),
  ``verify`` (SSA, beta = 0, one conv per region, no aliasing; raises FusionError),
  ``space_to_depth_stem`` (CUDA inference where Triton runs and ``backends`` names
  ``triton_stem``: a stem region takes its SpaceToDepth as prologue, for that backend).
* **post_lowering**: ``four_channel_images`` (CUDA: PyTorch stems on 3-channel fp16/bf16 images
  get a zero fourth channel), ``channel_padded_images`` (CUDA inference: images a cuDNN region
  zero-pads are padded in the graph), ``channels_last_activations`` (values regions read
  channels_last are converted where they are made), ``nchw_padded_avg_pools`` (CUDA training:
  padded pools get NCHW inputs, a PyTorch backward bug), ``se_gates`` and ``se_scales`` (CUDA
  inference where Triton runs: an SE gate -> one ``se_gate`` kernel, then the multiply by it and
  the block's tail -> one ``se_scale`` kernel), the user's own passes (option ``passes``),
  ``hoist`` (CUDA inference in a CUDA graph: parameter-only subgraphs recomputed when the
  parameters change).
* **glue** (on the copy of the lowered graph that Inductor compiles): ``library_ops`` (this
  package's kernels called through their ``torch.library`` ops), ``small_linears`` (small linear
  layers -> reductions).

Which passes a specialization runs depends on its :class:`~fusion_compiler.config.Target` and
the :class:`~fusion_compiler.config.CompileOptions` (:func:`pipelines`); the reasons for each
condition are in ``docs/decisions.md``. After each pre-fusion and fusion pass the manager
propagates shapes again; the post-lowering and glue passes keep node metadata themselves.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.fx as fx

from ..config import CompileOptions, Target
from ..ir.errors import FusionError
from ..kernels.space_to_depth import triton_reason
from .fusion.fuse import fuse_regions
from .fusion.space_to_depth_stem import space_to_depth_stems
from .fusion.verify import verify
from .glue import kernels_as_library_ops, small_linears_as_reductions
from .manager import Pass, PassManager
from .post_lowering.hoist import hoist_parameters
from .post_lowering.se_gate import se_gates, se_scales
from .post_lowering.layout import (channel_padded_images, channels_last_activations,
                                   four_channel_images, nchw_padded_avg_pools)
from .pre_fusion.autocast import make_autocast_explicit
from .pre_fusion.cse import eliminate_common_subexpressions
from .pre_fusion.views import canonical_views
from .pre_fusion.fold_bn import fold_batch_norm
from .pre_fusion.horizontal import horizontal_fusion
from .pre_fusion.identities import drop_identities
from .pre_fusion.normalize import normalize
from .pre_fusion.rewrites import avgpool_conv, space_to_depth_conv, strided_stem_conv

__all__ = ["Pass", "PassManager", "PIPELINES", "pipelines", "pass_names", "pre_fusion",
           "fusion", "post_lowering", "glue", "custom_passes", "normalize", "fold_batch_norm",
           "space_to_depth_conv", "strided_stem_conv", "avgpool_conv", "fuse_regions", "verify"]

log = logging.getLogger("fusion_compiler")
PIPELINES = ("pre_fusion", "fusion", "post_lowering", "glue")


def _counted(edit: Callable[[fx.GraphModule], object], what: str) -> Callable[[fx.GraphModule],
                                                                            fx.GraphModule]:
    """``edit`` (which returns a count or a list of what it changed) as a pass that logs that at
    INFO level when it is not empty."""
    @functools.wraps(edit)
    def run(gm: fx.GraphModule) -> fx.GraphModule:
        done = edit(gm)
        if done:
            log.info("%s: %s", what, ", ".join(done) if isinstance(done, list) else done)
        return gm
    return run


def pre_fusion(options: CompileOptions, target: Target) -> list[Pass]:
    """Normalization and the exact rewrites; the rewrites that exist for cuDNN run for CUDA
    inputs (or ``options.cuda_pipeline``) only, horizontal fusion in inference, the autocast pass
    under ``torch.autocast``."""
    cuda = target.cuda or bool(options.cuda_pipeline)
    passes = [Pass("normalize", functools.partial(normalize, differentiable=target.training)),
              Pass("identities", _counted(drop_identities, "ops that return their input removed")),
              Pass("canonical_views", _counted(canonical_views, "views written as reshapes")),
              Pass("cse", _counted(eliminate_common_subexpressions,
                                   "common subexpressions merged")),
              Pass("fold_bn", fold_batch_norm)]
    if cuda:
        passes += [Pass("space_to_depth", space_to_depth_conv),
                   Pass("strided_stem", strided_stem_conv), Pass("avgpool_conv", avgpool_conv)]
        if options.horizontal_fusion and not target.training:
            passes.append(Pass("horizontal_fusion", horizontal_fusion))
    if target.autocast is not None:  # casts before fusion, so regions form in the autocast dtype
        passes.append(Pass("autocast", functools.partial(make_autocast_explicit,
                                                         dtype=target.autocast)))
    return passes + custom_passes(options, "pre_fusion")


def fusion(options: CompileOptions, target: Target) -> list[Pass]:
    """The fuse pass (``fuse_prologue``, ``fuse_reduction``), verify, and in CUDA inference where
    Triton runs the SpaceToDepth stems."""
    passes = [Pass("fuse", functools.partial(fuse_regions, prologue=options.fuse_prologue,
                                             reduction=options.fuse_reduction)),
              Pass("verify", verify)]
    if target.cuda and not target.training and "triton_stem" in options.backends \
            and not triton_reason():
        passes.append(Pass("space_to_depth_stem", space_to_depth_stems))
    return passes


def post_lowering(options: CompileOptions, target: Target) -> list[Pass]:
    """The edits after lowering, each where it applies (see the module docstring)."""
    inference = not target.training
    passes = []
    if target.cuda:
        passes.append(Pass("four_channel_images", _counted(
            four_channel_images, "regions on PyTorch ops convolve a 4-channel image")))
        if inference:
            passes.append(Pass("channel_padded_images", _counted(
                channel_padded_images, "images zero-padded in the graph")))
    passes.append(Pass("channels_last_activations", _counted(
        channels_last_activations, "values made channels_last where they are made")))
    if target.cuda and target.training:
        passes.append(Pass("nchw_padded_avg_pools", _counted(
            nchw_padded_avg_pools, "padded avg_pool2d inputs made NCHW: PyTorch's channels_last "
            "CUDA backward is wrong with padding (pytorch/pytorch#188344)")))
    if inference and (target.cuda and not triton_reason() or options.cuda_pipeline):
        passes += [Pass("se_gates", _counted(se_gates, "SE gates as one se_gate kernel each")),
                   Pass("se_scales", _counted(se_scales, "SE gates applied (with the block's "
                                                         "tail) in the gate's kernel"))]
    passes += custom_passes(options, "post_lowering")
    # kept current by the graph's derivation prologue (or recomputed before each ungraphed call)
    if options.graphed_inference(target) or (inference and options.cuda_pipeline):
        passes.append(Pass("hoist", hoist_parameters))
    return passes


def custom_passes(options: CompileOptions, pipeline: str) -> list[Pass]:
    """The user's passes for ``pipeline`` (option ``passes``), each named ``user:<its name>``
    in the stage list.

    Raises (when a pass runs):
        FusionError: the pass raised, or returned something other than a ``GraphModule`` or
            ``None`` (the message names the pass and the pipeline).
    """
    return [Pass(f"user:{getattr(fn, '__name__', type(fn).__name__)}",
                 functools.partial(_run_custom, fn, pipeline))
            for fn in options.custom_passes(pipeline)]


def _run_custom(fn: Callable[[fx.GraphModule], object], pipeline: str,
                gm: fx.GraphModule) -> fx.GraphModule:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        result = fn(gm)
    except Exception as exc:
        raise FusionError(f"the {pipeline} pass {name} (option passes) raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if result is None:
        return gm
    if not isinstance(result, fx.GraphModule):
        raise FusionError(f"the {pipeline} pass {name} (option passes) returned "
                          f"{type(result).__name__}; a pass returns the GraphModule or None")
    return result


def glue() -> list[Pass]:
    """The rewrites of the copy of a lowered graph that Inductor compiles."""
    return [Pass("library_ops", _counted(kernels_as_library_ops,
                                         "this package's kernels called through their ops")),
            Pass("small_linears", _counted(small_linears_as_reductions,
                                           "small linear layers as reductions"))]


def pipelines(options: CompileOptions, target: Target) -> dict[str, list[Pass]]:
    """Every pipeline a specialization for ``target`` runs, by name (:data:`PIPELINES`)."""
    return {"pre_fusion": pre_fusion(options, target), "fusion": fusion(options, target),
            "post_lowering": post_lowering(options, target), "glue": glue()}


def pass_names() -> dict[str, list[str]]:
    """The name of every pass any pipeline may run, by pipeline, in order."""
    everything = CompileOptions()
    inference = pipelines(everything, Target(cuda=True))
    training = pipelines(everything, Target(cuda=True, training=True, autocast=torch.float16))
    names: dict[str, list[str]] = {}
    for pipeline in PIPELINES:
        merged = [p.name for p in inference[pipeline]]
        previous = None
        for p in training[pipeline]:  # each training-only pass after its predecessor
            if p.name not in merged:
                merged.insert(merged.index(previous) + 1 if previous else 0, p.name)
            previous = p.name
        names[pipeline] = merged
    if "space_to_depth_stem" not in names["fusion"]:  # added only where Triton runs
        names["fusion"].append("space_to_depth_stem")
    if "se_gates" not in names["post_lowering"]:  # likewise
        at = names["post_lowering"].index("hoist")
        names["post_lowering"][at:at] = ["se_gates", "se_scales"]
    return names
