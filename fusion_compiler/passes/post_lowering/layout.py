"""Memory layout of the values between regions of a lowered graph.

cuDNN regions read and write fully packed channels_last (NHWC) tensors, so the PyTorch ops between
them see channels_last where eager saw NCHW. Graph edits, made after lowering:

* :func:`channels_last_activations`: a 4-d value that cuDNN regions read (a graph input, or a
  PyTorch op's output) is converted once, where it is made, instead of inside each reading region;
* :func:`channel_padded_images`: in inference, an image a cuDNN region zero-pads to more channels
  is padded in the graph, where Inductor makes it in one kernel;
* :func:`four_channel_images`: on CUDA, a region left to PyTorch whose convolution reads a
  3-channel fp16/bf16 image (an RGB stem) gets a zero fourth channel in image and weight;
* :func:`nchw_padded_avg_pools`: in a training graph on CUDA, an ``avg_pool2d`` with padding gets
  an NCHW input, because PyTorch's CUDA backward of ``avg_pool2d`` for a channels_last input with
  ``padding > 0`` returns wrong input gradients (pytorch/pytorch#188344: the NHWC backward kernel
  leaves the padding offset out of the input coordinates; measurements: docs/decisions.md,
  "Padded ``avg_pool2d`` made NCHW in training").
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.ops import avg_pool2d_args, is_call
from ...ir.region import called_region, channel_view_total

__all__ = ["channels_last_activations", "channel_padded_images", "four_channel_images",
           "nchw_padded_avg_pools", "NHWC_OUTPUT_BACKENDS"]


#: Backends whose region outputs are channels_last: cuDNN's, and the Triton kernels of
#: :mod:`fusion_compiler.backends.triton_stem` and :mod:`fusion_compiler.backends.triton`.
NHWC_OUTPUT_BACKENDS = ("cudnn", "triton_stem", "triton_conv")


def _made_channels_last(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is an output of a region that writes channels_last (``getitem`` of its
    call; :data:`NHWC_OUTPUT_BACKENDS`)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    region = called_region(gm, node.args[0])
    return region is not None and region.backend in NHWC_OUTPUT_BACKENDS


def _reroute_through(gm: fx.GraphModule, node: fx.Node, readers: list[fx.Node],
                     steps: list[tuple[str, Any, tuple, dict]]) -> None:
    """Insert after ``node`` the ops ``steps`` (``(op, target, args, kwargs)``, each applied to
    the previous value: ``call_method`` or ``call_function``) and make ``readers`` read the last
    one instead of ``node``. Each new node's ``meta["val"]`` is its op applied to the previous
    one's."""
    value, val = node, node.meta["val"]
    # before node.next, not after node: inserting_after(node) would put each new node right
    # after node, so the chain would come out reversed
    with gm.graph.inserting_before(node.next):
        for op, target, args, kwargs in steps:
            value = gm.graph.create_node(op, target, (value, *args), kwargs)
            val = (getattr(val, target)(*args, **kwargs) if op == "call_method"
                   else target(val, *args, **kwargs))
            value.meta["val"] = val
    for reader in readers:
        reader.replace_input_with(node, value)


def channel_padded_images(gm: fx.GraphModule) -> int:
    """Pad each image that cuDNN regions zero-pad to more input channels
    (``Region.padded_images``) in the graph instead, once per image and channel count (in
    place); returns how many pads were added. For inference graphs only: a training region's
    backward reads its inputs as the graph hands them.

    The pad is the kernel's own (``x.permute(0, 2, 3, 1)``, ``F.pad`` of the channels, permuted
    back: a channels_last tensor), and the kernel takes a tensor so padded as it is. Eager, the
    same two kernels run (a fill and a copy); under Inductor they become one kernel that reads the
    NCHW image and writes the padded channels_last one, faster than the region's fill and copy
    (measurements: docs/decisions.md, "Images padded in the graph").
    """
    added = 0
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 4:
            continue
        readers: dict[int, list[fx.Node]] = {}
        for user in node.users:
            region = called_region(gm, user)
            if region is None or region.backend != "cudnn":  # PyTorch's ops take C channels
                continue
            for at, channels in region.padded_images.items():
                if user.args[at] is node and channels > val.shape[1]:
                    readers.setdefault(channels, []).append(user)
        for channels, users in readers.items():
            pad = (0, channels - val.shape[1])
            _reroute_through(gm, node, users, [("call_method", "permute", ((0, 2, 3, 1),), {}),
                                               ("call_function", F.pad, (pad,), {}),
                                               ("call_method", "permute", ((0, 3, 1, 2),), {})])
            added += 1
    if added:
        gm.recompile()
    return added


def four_channel_images(gm: fx.GraphModule) -> int:
    """Give the convolution of every region left to PyTorch (not lowered to cuDNN) that reads a
    3-channel fp16/bf16 image a fourth, zero channel, in the image and in the weight (in place);
    returns how many regions changed. The sum gains zero terms only: the same values. For CUDA
    graphs.

    The zero channel is added in the graph, before the region call (``F.pad``), and the region's
    placeholders take the 4-channel shapes. The weight's padding depends on the parameter alone, so
    in inference it is computed once per parameter version (:mod:`.hoist`); the image's fuses, under
    Inductor, with its channels_last conversion (:func:`channels_last_activations`, run after).
    Regions lowered to cuDNN are left alone: their kernel pads the image to 4 channels itself, and
    a 4-channel image before that was one more copy.

    Four channels, not 3 or 8: with 3, Inductor's NCHW -> NHWC copy of the image is slower and
    PyTorch's cuDNN call adds a padding kernel of its own (``nhwcAddPaddingKernel``); with 8 the
    stem was slower still (measurements: docs/decisions.md, "Four-channel images for PyTorch
    stems").
    """
    changed = 0
    for call in list(gm.graph.nodes):
        region = called_region(gm, call)
        if region is None or region.backend == "cudnn" or region.conv.args[6] != 1:
            continue
        conv = region.conv
        image, weight = conv.args[0], conv.args[1]
        if (image.op != "placeholder" or weight.op != "placeholder" or len(image.users) != 1
                or len(weight.users) != 1):  # read by the convolution alone
            continue
        x, w = image.meta.get("val"), weight.meta.get("val")
        if (not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != 3
                or x.dtype not in (torch.float16, torch.bfloat16) or w.shape[1] != 3):
            continue
        names = [n.name for n in region.graph_module.graph.find_nodes(op="placeholder")]
        args = list(call.args)
        for ph in (image, weight):
            at = names.index(ph.name)
            with gm.graph.inserting_before(call):
                args[at] = gm.graph.call_function(F.pad, (args[at], (0, 0, 0, 0, 0, 1)))
            args[at].meta["val"] = ph.meta["val"] = F.pad(ph.meta["val"], (0, 0, 0, 0, 0, 1))
        call.args = tuple(args)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def channels_last_activations(gm: fx.GraphModule) -> int:
    """Convert each 4-d value that regions read as a channels_last activation
    (``Region.nhwc_inputs``: cuDNN kernels, and regions left to PyTorch because their ops timed
    faster on channels_last inputs) to channels_last once, right where it is made, unless a region
    that writes channels_last made it or it is a channel view of such a region's output (a
    horizontally fused convolution's; the kernels read it in place) (in place); returns how many
    values were converted.

    Without it, every reading cuDNN region converts the value itself, inside its kernel: a graph
    input or a PyTorch op's NCHW output read by two regions is copied twice (resnet50's max-pool
    output, one copy in each of the two regions reading it), and a region left to PyTorch runs its
    convolution on NCHW data, which is slower than on channels_last. Under Inductor the conversion
    also fuses into the kernel that makes the value, because a custom op's inputs get the strides
    they had when the graph was traced (measurements: docs/decisions.md, "channels_last
    activations converted where made").
    """
    converted = 0
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 4 or _made_channels_last(gm, node) \
                or channel_view_total(node) is not None:  # its readers take the view as it is
            continue
        readers = [u for u in node.users if (region := called_region(gm, u)) is not None
                   and any(u.args[i] is node for i in region.nhwc_inputs)]
        if not readers:
            continue
        _reroute_through(gm, node, readers, [("call_method", "contiguous", (),
                                              {"memory_format": torch.channels_last})])
        converted += 1
    if converted:
        gm.recompile()
    return converted


def nchw_padded_avg_pools(gm: fx.GraphModule) -> int:
    """Make the input of every ``F.avg_pool2d`` call with padding NCHW-contiguous (in place; a
    no-op copy for an input that already is); returns how many pools were changed.

    Call it on training graphs that run on CUDA (see the module docstring for why). The pool's
    forward value is unchanged; its backward then takes PyTorch's NCHW kernel. Costs one copy of
    the pool input per call when it arrives channels_last.
    """
    changed = 0
    for pool in list(gm.graph.nodes):
        if not is_call(pool, F.avg_pool2d):
            continue
        args = avg_pool2d_args(pool)
        padding, source = args["padding"], args["input"]
        if not any(p > 0 for p in ((padding,) if isinstance(padding, int) else padding)):
            continue
        with gm.graph.inserting_before(pool):
            nchw = gm.graph.call_method("contiguous", (source,))
        pool.replace_input_with(source, nchw)
        changed += 1
    if changed:
        gm.recompile()
    return changed
