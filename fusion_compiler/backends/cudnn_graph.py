"""Region -> ``cudnn.pygraph`` construction (no GPU needed).

The graph follows the cuDNN graph rules (CUDNN_FACTS.md; cuDNN frontend "Graph API" docs):

* I/O tensors are the region's inputs and outputs, declared in the logical NCHW order of
  dimensions with **fully packed NHWC strides** (channels_last): ``[N,C,H,W]`` has strides
  ``[C*H*W, 1, W*C, C]``, weights ``[K,C,R,S]`` likewise ``[C*R*S, 1, S*C, C]``.
* Scalar operands are ``[1,1,1,1]``, per-channel operands ``[1,K,1,1]`` (strides ``[K,1,K,K]``);
  Python numbers become pass-by-value scalars (``is_pass_by_value=True``, fp32).
* Every op output is virtual unless it is a region output (``set_output(True)``), intermediate and
  compute types are fp32, and prologue outputs are stored in the I/O type (cuDNN rejects a
  prologue left at fp32 on SM 9.0, CUDNN_FACTS.md "Support surface"); the reduction output is
  fp32 (see :func:`output_dtype`).
* The convolution is ``conv_fprop`` with alpha = 1, beta = 0 (accumulation is an explicit ``add``);
  groups follow from the weight's shape. The H, W sum is a ``reduction(mode=ADD)`` whose output is
  ``[N,K,1,1]``.

:func:`build_graph` returns the graph and the mapping from region inputs/outputs to graph tensors;
:func:`graph_json` its JSON as a ``dict``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..errors import UnsupportedError
from ..ops import BINARY, is_conv, is_hw_sum
from ..region import Region

__all__ = ["CudnnGraph", "build_graph", "graph_json", "nhwc_strides", "to_nhwc", "cudnn_dtype",
           "import_cudnn", "channel_padding", "output_dtype"]


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


def nhwc_strides(shape: tuple[int, ...]) -> list[int]:
    """Fully packed channels_last strides (elements) of a logical NCHW ``shape`` of rank 4."""
    n, c, h, w = shape
    return [c * h * w, 1, w * c, c]


def to_nhwc(t: torch.Tensor) -> torch.Tensor:
    """``t`` fully packed channels_last (a no-op when it already is), as graph I/O is declared."""
    return t.contiguous(memory_format=torch.channels_last)


def cudnn_dtype(dtype: torch.dtype):
    """``torch.float16``/``bfloat16``/``float32`` -> ``cudnn.data_type``.

    Raises:
        UnsupportedError: for any other dtype.
    """
    cudnn = import_cudnn()
    table = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16,
             torch.float32: cudnn.data_type.FLOAT}
    if dtype not in table:
        raise UnsupportedError(f"dtype {dtype} is not fused (fp16, bf16 and fp32 are)")
    return table[dtype]


@dataclass
class CudnnGraph:
    """A built (not yet planned) cuDNN graph of one region.

    ``inputs[i]`` is the graph tensor of the region's i-th input (placeholder order), ``outputs[j]``
    of its j-th output; ``constants`` are pass-by-value scalars with their host values (fp32,
    shape ``[1,1,1,1]``, on the CPU as cuDNN requires).
    """

    graph: Any
    inputs: list[Any]
    outputs: list[Any]
    constants: list[tuple[Any, torch.Tensor]] = field(default_factory=list)


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _as4d(shape: tuple[int, ...]) -> list[int]:
    return [1] * (4 - len(shape)) + list(shape)


def channel_padding(region: Region) -> tuple[int, set[str]] | None:
    """``(C_padded, names of the placeholders to pad)`` when the convolution's input channel count
    ``C`` is not a multiple of 8 (fp16/bf16) or 4 (fp32) (CUDNN_FACTS.md "Support surface"), else
    ``None``. Padding the image and the weight with zero channels is exact when ``groups == 1`` and
    every prologue operand is a scalar (the padded channels then meet zero weights); otherwise
    ``None`` is returned too and cuDNN decides.
    """
    conv = region.conv
    weight, groups = conv.args[1], conv.args[6]
    c = weight.meta["val"].shape[1]
    multiple = 4 if conv.args[0].meta["val"].dtype == torch.float32 else 8
    if c % multiple == 0 or groups != 1 or weight.op != "placeholder":
        return None
    image = conv.args[0]
    while image.op != "placeholder":
        if not (image.target in BINARY and _is_scalar(image.args[1])):
            return None
        image = image.args[0]
    return -(-c // multiple) * multiple, {image.name, weight.name}


def _is_scalar(arg: Any) -> bool:
    return not isinstance(arg, fx.Node) or arg.meta["val"].numel() == 1


def build_graph(region: Region, handle: Any = None) -> CudnnGraph:
    """Build the ``cudnn.pygraph`` of ``region`` (see module docstring); no GPU needed.

    Args:
        region: a fused region whose graph nodes carry ``meta["val"]``.
        handle: a ``cudnn`` handle for execution; ``None`` to only describe the graph.

    Raises:
        UnsupportedError: cuDNN frontend missing, or an op/dtype this builder does not map.
    """
    cudnn = import_cudnn()
    conv = region.conv
    io_dtype = conv.args[0].meta["val"].dtype
    io = cudnn_dtype(io_dtype)
    kwargs = dict(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                  compute_data_type=cudnn.data_type.FLOAT)
    if handle is not None:
        kwargs["handle"] = handle
    g = cudnn.pygraph(**kwargs)
    values: dict[fx.Node, Any] = {}
    inputs, constants = [], []
    channel_pad = channel_padding(region)

    for node in region.graph_module.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            dims = _as4d(tuple(val.shape))
            if channel_pad is not None and node.name in channel_pad[1]:
                dims[1] = channel_pad[0]
            t = g.tensor(name=node.name, dim=dims, stride=nhwc_strides(tuple(dims)), data_type=cudnn_dtype(val.dtype))
            values[node] = t
            inputs.append(t)
        elif node.op == "output":
            continue
        elif is_conv(node):
            _, _, _, stride, padding, dilation, _groups = node.args
            values[node] = g.conv_fprop(image=values[node.args[0]], weight=values[node.args[1]],
                                        padding=list(padding), stride=list(stride),
                                        dilation=list(dilation),
                                        compute_data_type=cudnn.data_type.FLOAT, name=node.name)
        elif node.target in BINARY:
            a, b = (_operand(g, cudnn, values, arg, constants) for arg in node.args)
            op = getattr(g, BINARY[node.target])
            values[node] = op(a=a, b=b, compute_data_type=cudnn.data_type.FLOAT, name=node.name)
            if _before(node, conv):
                values[node].set_data_type(io)  # prologue output in the I/O type
        elif node.target is torch.relu:
            values[node] = g.relu(input=values[node.args[0]], name=node.name)
        elif node.target is torch.clamp:
            values[node] = g.relu(input=values[node.args[0]], lower_clip=float(node.args[1]),
                                  upper_clip=float(node.args[2]), name=node.name)
        elif node.target is torch.sigmoid:
            values[node] = g.sigmoid(input=values[node.args[0]], name=node.name)
        elif node.target is torch.tanh:
            values[node] = g.tanh(input=values[node.args[0]], name=node.name)
        elif is_hw_sum(node):
            n, k = _shape(node)[:2]
            r = g.reduction(input=values[node.args[0]], mode=cudnn.reduction_mode.ADD,
                            compute_data_type=cudnn.data_type.FLOAT, name=node.name)
            r.set_dim([n, k, 1, 1]).set_stride([k, 1, k, k])
            values[node] = r
        else:
            raise UnsupportedError(f"no cuDNN mapping for {node.op} {node.target}", region.region_id)

    outputs = []
    for out in region.output_nodes:
        t = values[out]
        dims = _as4d(tuple(out.meta["val"].shape))
        t.set_output(True).set_data_type(cudnn_dtype(output_dtype(out))).set_dim(dims).set_stride(
            nhwc_strides(tuple(dims)))
        outputs.append(t)
    return CudnnGraph(g, inputs, outputs, constants)


def output_dtype(node: fx.Node) -> torch.dtype:
    """The dtype cuDNN writes a region output in: the node's own, except fp32 for the H, W sum.

    Measured on an H100 (cuDNN 9.19): a conv graph ending in a ``reduction`` builds only when the
    reduction output is FLOAT; with a HALF output every variant (with or without prologue or extra
    output) is declined with "No valid engine configs".
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


def _operand(g, cudnn, values: dict, arg: Any, constants: list) -> Any:
    if isinstance(arg, fx.Node):
        return values[arg]
    host = torch.full((1, 1, 1, 1), float(arg), dtype=torch.float32)
    t = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                 is_pass_by_value=True)
    constants.append((t, host))
    return t


def graph_json(region: Region) -> dict:
    """The cuDNN graph of ``region`` as the frontend prints it, parsed into a ``dict``."""
    return json.loads(str(build_graph(region).graph))
