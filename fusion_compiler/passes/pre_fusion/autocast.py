"""autocast: make ``torch.autocast``'s casts explicit where regions form.

A graph specialized under ``torch.autocast(dtype=float16 or bfloat16)`` keeps fp32 parameters.
Autocast casts a convolution's input and weight to the low-precision type when the op runs, and
PyTorch's type promotion then makes ``conv_out + fp32_bias`` an fp32 tensor, which ends a region
(the fuse pass does not fuse a type promotion). This pass writes the casts into the graph:

* the image and weight of every ``conv2d`` are cast to ``dtype`` (what autocast does at run time);
* in an ``add``/``sub``/``mul``/``div`` whose one tensor operand is in ``dtype`` and the other in
  fp32, the fp32 operand is cast to ``dtype``, so epilogues stay in ``dtype`` and fuse (cuDNN
  computes them in fp32 internally anyway). Eager autocast would compute these in fp32: results
  differ by low-precision rounding of the operand, and such ops return ``dtype`` instead of fp32;
* an output of the graph that these casts left in ``dtype`` where eager returns fp32 (a Fixup
  block's ``conv(x) + fp32_bias`` at the end of a network) is cast back to eager's dtype, so a
  caller gets the dtypes the module returns under autocast.

Every other op is left to autocast itself at run time (the compiled graph runs inside the
caller's autocast context). Casts of parameters are parameter-only work, which inference
specializations hoist. Gradients flow through the casts back to the fp32 parameters.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...ir.ops import BINARY, is_conv
from ..manager import CAPTURED_OUTPUT_DTYPES

__all__ = ["make_autocast_explicit"]


_SAME_DTYPE = {torch.relu, torch.sigmoid, torch.tanh, torch.clamp, F.silu, torch.reshape,
               torch.permute, torch.flatten, torch.narrow, torch.squeeze, torch.unsqueeze,
               torch.transpose}
"""Ops whose output has their first operand's dtype: a cast before one carries through it (the
channel views ``horizontal_fusion`` writes, ``narrow``, are among them: without them a convolution
reading one got a cast of a value already in ``dtype``)."""
_SAME_DTYPE_METHODS = {"view", "reshape", "contiguous", "flatten", "permute", "transpose",
                       "squeeze", "unsqueeze", "narrow", "t", "expand", "relu", "sigmoid", "tanh",
                       "clamp"}
"""The same, as tensor methods."""


def make_autocast_explicit(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """Insert ``.to(dtype)`` casts (see module docstring); needs ``meta["val"]`` on nodes.

    Dtypes are tracked as the pass goes (a cast changes the dtype of the ops after it); ops the
    pass does not know keep the dtype fake-tensor propagation recorded under autocast. A graph
    run as PyTorch ops (``gm.meta["fusion_off"]``: in-place writes kept, a ``torch.autocast``
    block of its own) is left to autocast itself.
    """
    if gm.meta.get("fusion_off"):
        return gm
    graph = gm.graph
    casts: dict[fx.Node, fx.Node] = {}
    dtypes: dict[fx.Node, torch.dtype] = {}

    def dtype_of(arg: object) -> torch.dtype | None:
        if not isinstance(arg, fx.Node):
            return None
        if arg in dtypes:
            return dtypes[arg]
        val = arg.meta.get("val")
        return val.dtype if isinstance(val, torch.Tensor) else None

    def cast(node: fx.Node, before: fx.Node) -> fx.Node:
        if node not in casts:
            with graph.inserting_before(before):
                casts[node] = graph.call_method("to", (node, dtype))
            dtypes[casts[node]] = dtype
        return casts[node]

    for node in list(graph.nodes):
        if is_conv(node):
            for i in (0, 1):
                if dtype_of(node.args[i]) == torch.float32:
                    node.update_arg(i, cast(node.args[i], node))
            dtypes[node] = dtype
        elif node.op == "call_function" and node.target in BINARY and len(node.args) == 2:
            kinds = [dtype_of(a) for a in node.args]
            if dtype in kinds and torch.float32 in kinds:
                i = kinds.index(torch.float32)
                node.update_arg(i, cast(node.args[i], node))
                kinds[i] = dtype
            tensor_kinds = {k for k in kinds if k is not None}
            if len(tensor_kinds) == 1:
                dtypes[node] = tensor_kinds.pop()
        elif (node.op == "call_function" and node.target in _SAME_DTYPE) or (
                node.op == "call_method" and node.target in _SAME_DTYPE_METHODS):
            source = node.args[0] if node.args else node.kwargs.get("input")
            if dtype_of(source) is not None:
                dtypes[node] = dtype_of(source)
    _eager_output_dtypes(gm, dtype)
    graph.lint()
    gm.recompile()
    return gm


def _eager_output_dtypes(gm: fx.GraphModule, dtype: torch.dtype) -> None:
    """Cast each floating tensor output that eager returns in another dtype than ``dtype`` (the
    captured graph's, recorded by the pass manager) to it, whatever the pass tracked: a dtype
    fake-tensor propagation recorded before the casts is no guide (a ``conv + fp32 bias`` it saw
    promoted to fp32 may now be in ``dtype``, and the ops after it, tracked or not, carry the old
    dtype on), and a cast to the dtype a tensor has returns it as it is (no kernel, no autograd
    node). An output eager returns in ``dtype`` is in ``dtype`` here too: the pass only casts to
    it. Nothing where the record is missing or the outputs changed in number."""
    eager = gm.meta.get(CAPTURED_OUTPUT_DTYPES)
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    flat, spec = tree_flatten(output.args[0])
    if eager is None or len(eager) != len(flat):
        return
    restored = []
    for node, want in zip(flat, eager):
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if (want is None or want == dtype or not want.is_floating_point
                or not isinstance(val, torch.Tensor)):
            restored.append(node)
            continue
        with graph.inserting_before(output):  # its metadata: the pass manager's propagation
            restored.append(graph.call_method("to", (node, want)))
    output.args = (tree_unflatten(restored, spec),)
