"""What a region's PyTorch ops are timed as: the ops as the graph will run them when the region
falls back to the reference backend.

A region that runs on the reference backend is not run op by op in the compiled graph: its ops
join the glue, and Inductor (the default glue compiler on CUDA) calls PyTorch's convolution and
fuses the pointwise ops after it into one kernel. Timed eagerly, every one of those ops is a pass
over the convolution's output, so the region's PyTorch ops looked slower than they run. For
ResNet's 7x7 stride-2 stem (N=32, fp16, H200) eager ops took 0.238 ms, cuDNN's fused plan 0.230,
and the convolution in the compiled graph about 0.06 ms plus one pass: cuDNN was chosen and the
forward got 0.127 ms slower (docs/decisions.md, "Regions timed against PyTorch ops as compiled
glue runs them").

:func:`pytorch_stand_in` returns what is timed instead while the glue is expected to be
compiled (the default; :func:`eager_glue` switches back to the region's own ops for eager glue).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.fx as fx

from ..ir.ops import is_hw_sum
from ..runtime.background import ThreadFlag

__all__ = ["eager_glue", "pytorch_stand_in", "pytorch_timing_record", "timed_as"]

_EAGER = ThreadFlag()


@contextlib.contextmanager
def eager_glue():
    """Within it, on this thread, a region's PyTorch ops are timed as themselves, one kernel per
    op: the glue will run eagerly (lowering enters it where
    :func:`~fusion_compiler.passes.glue.glue_compiled_expected` says so)."""
    with _EAGER.raised():
        yield


def timed_as() -> str:
    """How the region's PyTorch ops are timed now, in a few words for a report or a cache key."""
    return "eager ops" if _EAGER else "as compiled glue runs them"


def pytorch_timing_record() -> str:
    """The name under which a plan cache stores a cuDNN plan's timing against the PyTorch ops
    (a method of measuring has a name of its own, so a stored timing is never read as another's,
    see :meth:`~fusion_compiler.backends.cudnn.plan.CudnnPlan.timed_against_pytorch`)."""
    return "pytorch_timing_paired" if _EAGER else "pytorch_timing_glue"


def pytorch_stand_in(region) -> Callable[..., object]:
    """A callable taking ``region``'s inputs (in placeholder order) that does the work its
    PyTorch ops do in the compiled glue, for timing only (its result is not the region's):

    - the ops up to and including the convolution, as they are (Inductor calls PyTorch's
      convolution as an extern kernel, and a prologue op is counted as its own pass);
    - then one pointwise pass that reads the convolution's output ``[N, K, P, Q]`` and every
      region input of that shape that an op after the convolution reads (a residual, the
      block's input included), and writes one tensor of that shape: Inductor's fused epilogue
      (none where no op follows the convolution). Each further output of that shape adds a
      pass, each sum over ``(H, W)`` (an exit reduction) a reduction of the output.

    Under :func:`eager_glue` it is the region's own graph module.
    """
    gm = region.graph_module
    if _EAGER:
        return gm
    conv = region.conv
    shape = tuple(conv.meta["val"].shape)
    nodes = list(gm.graph.nodes)
    tail = set(nodes[nodes.index(conv) + 1:])
    full = [i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder"))
            if tuple(ph.meta["val"].shape) == shape and any(u in tail for u in ph.users)]
    sums = sum(is_hw_sum(n) for n in tail)
    pointwise = any(n.op in ("call_function", "call_method") and not is_hw_sum(n) for n in tail)
    # outputs of the chain after the first (the convolution's own value and sums are no pass)
    extra = max(0, sum(isinstance(n, fx.Node) and n is not conv and not is_hw_sum(n)
                       and tuple(n.meta["val"].shape) == shape
                       for n in region.output_nodes) - 1)
    prefix = _up_to_conv(gm, conv)

    def run(*inputs: torch.Tensor) -> None:
        y = prefix(*inputs)
        if pointwise:
            _pointwise_pass(y, [inputs[i] for i in full])
        for _ in range(extra):
            torch.relu(y)
        for _ in range(sums):
            y.sum((2, 3))

    return run


def _up_to_conv(gm: fx.GraphModule, conv: fx.Node) -> fx.GraphModule:
    """``gm``'s placeholders and its ops up to ``conv``, returning ``conv``'s value."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        env[node] = graph.node_copy(node, env.__getitem__)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        if node is conv:
            break
    graph.output(env[conv])
    return fx.GraphModule(gm, graph)


def _pointwise_pass(y: torch.Tensor, operands: Sequence[torch.Tensor]) -> torch.Tensor:
    """One kernel reading ``y`` and up to two ``operands`` and writing one tensor like ``y``
    (a further operand, rare, costs one more kernel)."""
    if not operands:
        return torch.relu(y)
    if len(operands) == 1:
        return torch.add(y, operands[0])
    out = torch.addcmul(y, operands[0], operands[1])
    for extra in operands[2:]:
        out = torch.add(out, extra)
    return out
