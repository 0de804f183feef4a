"""Region -> cuDNN graph recipe (:mod:`.recipe`) and ``cudnn.pygraph`` (no GPU needed).

The graph follows the cuDNN graph rules (docs/cudnn.md; cuDNN frontend "Graph API" docs):

* I/O tensors are the region's inputs and outputs, declared in the logical NCHW order of
  dimensions with **fully packed NHWC strides** (channels_last): ``[N,C,H,W]`` has strides
  ``[C*H*W, 1, W*C, C]``, weights ``[K,C,R,S]`` likewise ``[C*R*S, 1, S*C, C]``.
* Scalar operands are ``[1,1,1,1]``, per-channel operands ``[1,K,1,1]`` (strides ``[K,1,K,K]``);
  Python numbers become pass-by-value scalars (``is_pass_by_value=True``, fp32).
* Every op output is virtual unless it is a region output (``set_output(True)``), intermediate and
  compute types are fp32, and prologue outputs are stored in the I/O type (cuDNN rejects a
  prologue left at fp32 on SM 9.0: docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"); the
  reduction output is fp32 (see :func:`output_dtype`).
* The convolution is ``conv_fprop`` with alpha = 1, beta = 0 (accumulation is an explicit ``add``);
  groups follow from the weight's shape. The H, W sum is a ``reduction(mode=ADD)`` whose output is
  ``[N,K,1,1]``.

:func:`region_recipe` describes a region's graph as a recipe (plain data, what plans are built from
and keyed by); :func:`build_graph` builds it (the graph and its input/output tensors in region
order); :func:`graph_json` returns its JSON as a ``dict``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...ir.errors import UnsupportedError
from ...ir.ops import BINARY, is_conv, is_hw_sum
from ...ir.region import Region, channel_view_total
from ...runtime.tensors import channel_view_strides
from .recipe import CudnnGraph, build_pygraph, nhwc_strides

__all__ = ["CudnnGraph", "region_recipe", "build_graph", "graph_json", "nhwc_strides", "to_nhwc",
           "image_view_total",
           "recipe_dtype", "import_cudnn", "channel_padding", "output_padding", "padded_output",
           "output_dtype",
           "BATCHED_ROLES"]

BATCHED_ROLES = ("image", "full", "spatial")
"""Region input roles whose first dimension is the batch (:func:`.recipe.any_batch_key`)."""


def import_cudnn():
    """Import the cuDNN frontend (``nvidia-cudnn-frontend``, import name ``cudnn``).

    Raises:
        UnsupportedError: the package is not installed or fails to import.
    """
    try:
        import cudnn  # noqa: PLC0415  (optional at import time of fusion_compiler)
    except Exception as exc:  # ImportError, or OSError from a missing libcudnn
        raise UnsupportedError(f"the cuDNN frontend is not importable: {exc}") from exc
    return cudnn


def image_view_total(region: Region, node: fx.Node) -> int | None:
    """When placeholder ``node`` is the image of ``region``'s convolution and a channel view of a
    wider tensor (:func:`~fusion_compiler.ir.region.channel_view_total`; a horizontally fused
    convolution's output) that needs no channel padding: the wider tensor's channel count. The
    plan then reads the view in place, declared with the wider tensor's channels_last strides."""
    total = channel_view_total(node)
    if total is None or node is not region.conv.args[0]:
        return None
    pad = channel_padding(region)
    return None if pad is not None and node.name in pad[1] else total


def to_nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` fully packed channels_last (a no-op when it already is), as graph I/O is declared."""
    return t.contiguous(memory_format=torch.channels_last)


_RECIPE_DTYPES = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}


def recipe_dtype(dtype: torch.dtype) -> str:
    """``torch.float16``/``bfloat16``/``float32`` -> the recipe's data type name.

    Raises:
        UnsupportedError: for any other dtype.
    """
    if dtype not in _RECIPE_DTYPES:
        raise UnsupportedError(f"dtype {dtype} is not fused (fp16, bf16 and fp32 are)")
    return _RECIPE_DTYPES[dtype]


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _as4d(shape: tuple[int, ...]) -> list[int]:
    return [1] * (4 - len(shape)) + list(shape)


def _padded_count(conv: fx.Node, channels: int, image: bool = False) -> int | None:
    """``channels`` rounded up to the multiple cuDNN's NHWC engines need (8 for fp16/bf16, 4 for
    fp32), or ``None`` when it is one already or zero-padding does not apply: a grouped
    convolution, or a weight computed inside the region. An ``image`` (input channels) of fewer
    than 4 half-precision channels is padded to 4: the engines take it, and a stem's convolution
    on 4 channels ran faster than on 8 (3x3 stride 2 on 224x224, 32 outputs, N=32: 0.048 against
    0.064 ms; docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)")."""
    multiple = 4 if conv.args[0].meta["val"].dtype == torch.float32 else 8
    if channels % multiple == 0 or conv.args[6] != 1 or conv.args[1].op != "placeholder":
        return None
    if image and channels < 4:
        return 4
    return -(-channels // multiple) * multiple


def channel_padding(region: Region) -> tuple[int, set[str]] | None:
    """``(C_padded, names of the placeholders to pad)`` when the convolution's input channel count
    ``C`` is not a multiple of 8 (fp16/bf16) or 4 (fp32) (docs/cudnn.md, "Runtime-fusion support
    surface (SM 9.0)"), else ``None``; fewer than 4 half-precision channels are padded to 4.
    Padding the image and the weight with zero channels is exact when ``groups == 1`` and every
    prologue operand is a scalar (the padded channels then meet zero weights); otherwise ``None``
    is returned too and cuDNN decides. An image the epilogue also reads is padded as the output
    is (to a multiple of 8 or 4, never to 4 alone).
    """
    conv = region.conv
    channels = conv.args[1].meta["val"].shape[1]
    padded = _padded_count(conv, channels, image=True)
    if padded is None:
        return None
    image = conv.args[0]
    while image.op != "placeholder":
        if not (image.target in BINARY and _is_scalar(image.args[1])):
            return None
        image = image.args[0]
    if any(u is not conv and not _before(u, conv) for u in image.users):
        # the image is also an epilogue operand (a residual ``conv(x) + x``): it gets the
        # output's padded channel count (:func:`output_padding`), not the image's 4 (a 4-channel
        # x added to an 8-channel output was a graph of mismatched tensors; found by a review,
        # session 42)
        padded = _padded_count(conv, channels)
    return padded, {image.name, conv.args[1].name}


def output_padding(region: Region) -> tuple[int, set[str]] | None:
    """``(K_padded, names of the placeholders to pad)`` when the convolution's output channel
    count ``K`` is not a multiple of 8 (fp16/bf16) or 4 (fp32), which cuDNN's NHWC engines need
    (docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"), else ``None``.

    The graph then computes ``K_padded`` channels: the weight gets zero output channels
    (dimension 0), per-channel and full epilogue operands get channels of zeros (their channel
    dimension), and every output after the convolution has ``K_padded`` channels, of which the
    kernel returns the first ``K``. Exact for any epilogue, since its ops are pointwise per
    channel (or an H, W sum per channel): the padded channels never mix with the real ones.
    ``None`` too when padding cannot be exact or cheap: grouped convolutions (``groups != 1``), a
    weight computed in the region, an operand read both before and after the convolution.
    """
    conv = region.conv
    weight, k = conv.args[1], conv.meta["val"].shape[1]
    padded = _padded_count(conv, k)
    if padded is None:
        return None
    pads = {weight.name}
    roles = {o.name: o.role for o in region.operands()}
    for ph in region.graph_module.graph.find_nodes(op="placeholder"):
        if ph is weight or ph is conv.args[0]:
            continue
        after = [padded_output(u, conv) for u in ph.users]
        if not any(after):
            continue  # a prologue operand: input channels, not output channels
        if not all(after):
            return None
        if roles[ph.name] in ("channel", "full") and _as4d(tuple(ph.meta["val"].shape))[1] == k:
            pads.add(ph.name)
    return padded, pads


def padded_output(node: fx.Node, conv: fx.Node) -> bool:
    """Whether region output ``node`` is computed after ``conv`` (so has its output channels,
    padded with :func:`output_padding`)."""
    return node is conv or not _before(node, conv)


def _is_scalar(arg: Any) -> bool:
    return not isinstance(arg, fx.Node) or arg.meta["val"].numel() == 1


def region_recipe(region: Region) -> dict:
    """The cuDNN graph of ``region`` as a recipe (:mod:`.recipe`), following the module
    docstring's rules; region inputs are the recipe's inputs in placeholder order, region outputs
    its outputs. Inputs with a batch dimension (roles ``BATCHED_ROLES``) and outputs are marked
    ``"batched"``.

    Raises:
        UnsupportedError: an op or dtype this builder does not map.
    """
    conv = region.conv
    io = recipe_dtype(conv.args[0].meta["val"].dtype)
    channel_pad = channel_padding(region)
    out_pad = output_padding(region)
    roles = {o.name: o.role for o in region.operands()}
    inputs, ops = [], []

    def ref(arg: Any) -> Any:
        return arg.name if isinstance(arg, fx.Node) else {"scalar": float(arg)}

    for node in region.graph_module.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            dims = _as4d(tuple(val.shape))
            if channel_pad is not None and node.name in channel_pad[1]:
                dims[1] = channel_pad[0]
            if out_pad is not None and node.name in out_pad[1]:
                dims[0 if node is conv.args[1] else 1] = out_pad[0]
            strides = nhwc_strides(dims)
            if (total := image_view_total(region, node)) is not None:  # a channel view, laid
                strides = list(channel_view_strides(dims, total))  # out as the kernel checks
            inputs.append({"name": node.name, "dim": dims, "stride": strides,
                           "dtype": recipe_dtype(val.dtype),
                           "batched": roles[node.name] in BATCHED_ROLES})
        elif node.op == "output":
            continue
        elif is_conv(node):
            _, _, _, stride, padding, dilation, _groups = node.args
            ops.append({"op": "conv_fprop", "name": node.name,
                        "args": {"image": ref(node.args[0]), "weight": ref(node.args[1])},
                        "attrs": {"padding": list(padding), "stride": list(stride),
                                  "dilation": list(dilation)}})
        elif node.target in BINARY:
            op = {"op": BINARY[node.target], "name": node.name,
                  "args": {"a": ref(node.args[0]), "b": ref(node.args[1])}}
            if _before(node, conv):
                op["out"] = {"dtype": io}  # prologue output in the I/O type
            ops.append(op)
        elif node.target in (torch.relu, torch.sigmoid, torch.tanh):
            ops.append({"op": node.target.__name__, "name": node.name,
                        "args": {"input": ref(node.args[0])}})
        elif node.target is F.silu:
            ops.append({"op": "swish", "name": node.name, "args": {"input": ref(node.args[0])}})
        elif node.target is torch.clamp:
            ops.append({"op": "relu", "name": node.name, "args": {"input": ref(node.args[0])},
                        "attrs": {"lower_clip": float(node.args[1]),
                                  "upper_clip": float(node.args[2])}})
        elif is_hw_sum(node):
            n, k = _shape(node)[:2]
            k = k if out_pad is None else out_pad[0]
            ops.append({"op": "reduction_add", "name": node.name,
                        "args": {"input": ref(node.args[0])},
                        "out": {"dim": [n, k, 1, 1], "stride": [k, 1, k, k], "batched": True}})
        else:
            raise UnsupportedError(f"no cuDNN mapping for {node.op} {node.target}", region.region_id)
    outputs = []
    for out in region.output_nodes:
        dims = _as4d(tuple(out.meta["val"].shape))
        if out_pad is not None and padded_output(out, conv):
            dims[1] = out_pad[0]
        outputs.append({"ref": out.name, "dim": dims, "stride": nhwc_strides(dims),
                        "dtype": recipe_dtype(output_dtype(out)), "batched": True})
    return {"io": io, "inputs": inputs, "ops": ops, "outputs": outputs}


def build_graph(region: Region, handle: Any = None) -> CudnnGraph:
    """Build the ``cudnn.pygraph`` of ``region`` (see :func:`region_recipe`); no GPU needed.

    Args:
        region: a fused region whose graph nodes carry ``meta["val"]``.
        handle: a ``cudnn`` handle for execution; ``None`` to only describe the graph.

    Raises:
        UnsupportedError: cuDNN frontend missing, or an op/dtype this builder does not map.
    """
    recipe = region_recipe(region)
    import_cudnn()
    return build_pygraph(recipe, handle)


def output_dtype(node: fx.Node) -> torch.dtype:
    """The dtype cuDNN writes a region output in: the node's own, except fp32 for the H, W sum.

    A conv graph ending in a ``reduction`` builds only when the reduction output is FLOAT; with a
    HALF output cuDNN declines every variant (with or without prologue or extra output) with "No
    valid engine configs" (docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)").
    """
    return torch.float32 if is_hw_sum(node) else node.meta["val"].dtype


def _before(node: fx.Node, conv: fx.Node) -> bool:
    """``node`` comes before ``conv`` in the region graph (it is part of the prologue)."""
    for n in node.graph.nodes:
        if n is node:
            return True
        if n is conv:
            return False
    return False


def graph_json(region: Region) -> dict:
    """The cuDNN graph of ``region`` as the frontend prints it, parsed into a ``dict``."""
    return json.loads(str(build_graph(region).graph))
