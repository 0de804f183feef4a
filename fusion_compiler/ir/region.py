"""A fused region: one convolution with its prologue, epilogue and optional exit reduction, and
what lowering made of it.

In the fused graph each region is a ``call_module`` node whose module is a :class:`Region`. The
region's own ``torch.fx.GraphModule`` (``region.graph_module``) holds the canonical ops of
:mod:`fusion_compiler.ir.ops`; its placeholders are the region inputs (activations, the weight,
scalar/per-channel/full-tensor operands) and it returns a tuple of outputs (the chain's last
value, intermediates other nodes still read, and the reduction if any). The ops are fixed once the
fusion passes are done.

Lowering writes one :class:`Lowering` record per region (:meth:`Region.set_lowering`, once): the
backend that runs it, its kernel, and what the backend reports (plan, workspace, timings,
layouts). The region's read-only properties (``backend``, ``status``, ``kernel``, ...) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from .ops import BINARY, is_conv, is_hw_sum, op_name

__all__ = ["Region", "Lowering", "BackwardPlan", "Operand", "operand_kind", "called_region",
           "set_read_hook",
           "CHANNEL_VIEW", "channel_view_total"]

#: ``node.meta`` key of a value that is a channel view (``narrow`` along dim 1) of a wider 4-d
#: tensor, set by :mod:`fusion_compiler.passes.pre_fusion.horizontal`: the wider tensor's channel
#: count. Region placeholders inherit it from the node they stand for.
CHANNEL_VIEW = "channel_view"


def channel_view_total(node: fx.Node) -> int | None:
    """The channel count of the tensor ``node`` is a channel view of (:data:`CHANNEL_VIEW`), or
    ``None`` when it is not marked as one."""
    return node.meta.get(CHANNEL_VIEW)


def operand_kind(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> str | None:
    """Classify a pointwise operand by its broadcast shape against the conv output ``[N,K,P,Q]``.

    Returns ``"scalar"`` (``[1,1,1,1]``, any 1-element shape), ``"channel"`` (``[1,K,1,1]``),
    ``"spatial"`` (``[N,1,P,Q]``), ``"full"`` (``[N,K,P,Q]``), ``"sample_channel"`` (``[N,K,1,1]``,
    which cuDNN's runtime fusion engines do not take as an epilogue operand, see docs/cudnn.md,
    "Runtime-fusion support surface (SM 9.0)") or ``None`` for anything else.
    """
    if len(shape) > 4:
        return None
    s = (1,) * (4 - len(shape)) + tuple(shape)
    n, k, p, q = out_shape
    if all(d == 1 for d in s):
        return "scalar"
    # where shapes coincide the first kind wins: "channel" at N = 1 (a dict literal once let
    # "sample_channel" win there, and no batch norm or bias of a batch of one was fused), then,
    # for a 1x1 output, "sample_channel" (never fused) before "full" and "spatial"
    for kind, dims in (("channel", (1, k, 1, 1)), ("sample_channel", (n, k, 1, 1)),
                       ("full", (n, k, p, q)), ("spatial", (n, 1, p, q))):
        if s == dims:
            return kind
    return None


@dataclass(frozen=True)
class Operand:
    """One region input: ``role`` is ``image``, ``weight``, ``scalar``, ``channel``, ``spatial`` or
    ``full``; ``shape``/``stride`` in elements; ``dtype`` a ``torch.dtype``."""

    name: str
    role: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class BackwardPlan:
    """How a training region's backward runs, decided by lowering from the whole graph
    (:mod:`fusion_compiler.autograd.plan`).

    Attributes:
        no_grad_inputs: names of region inputs that never need a gradient (fed only by network
            inputs that do not require grad): no dgrad is built for them.
        dgrad_drelu, dgrad_drelu_reason: whether the convolution's dgrad applies the ReLU backward
            of the region producing its input, and why not (``""`` when it does).
        masked_outputs: names of ReLU output nodes whose gradient arrives already masked (the
            consuming region's dgrad applied the ReLU backward): the backward passes it through.
    """

    no_grad_inputs: frozenset[str] = frozenset()
    dgrad_drelu: bool = False
    dgrad_drelu_reason: str = ""
    masked_outputs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Lowering:
    """What lowering made of a region (written once, by :func:`fusion_compiler.lowering.lower`).

    Attributes:
        backend: the name of the backend that runs the region (``"cudnn"``, ``"triton_stem"``,
            ``"reference"``).
        status: ``"lowered"`` (the preferred backend took it) or ``"fallback"`` (PyTorch ops,
            ``reason`` says why).
        kernel: called with the region inputs, returns the tuple of outputs; ``None`` runs the
            region's own graph module.
        reason: why the region fell back (one line), else ``""``.
        plan, plan_from_cache, workspace_bytes: the execution plan's name, whether it came from the
            on-disk cache, its workspace in bytes (``None`` where there is none).
        graphs: per backend, the graph JSON it built for the region (the cuDNN graph, also on a
            machine without a GPU), for dumps.
        tuning: the plans autotuning built and timed (the backend's records), ranked order.
        timing: ms per call of each candidate timed against the others on the GPU (CUDA-graph
            timing), by backend name (``"reference"``: the region's PyTorch ops).
        gradients: in training, how each piece of the backward runs (the backend's records).
        nhwc_inputs: positions of the inputs the kernel reads as fully packed channels_last
            activations (also for PyTorch ops that were timed on such inputs); the
            ``channels_last_activations`` layout pass makes the graph hand them so.
        padded_images: ``{position: channels}``: inputs the kernel zero-pads to more channels
            before its plan runs, and takes as they come when they arrive so padded.
        backward: the backward plan of a training region, else ``None``.
    """

    backend: str
    status: str
    kernel: Callable[..., Any] | None = None
    reason: str = ""
    plan: str = ""
    plan_from_cache: bool | None = None
    workspace_bytes: int | None = None
    graphs: Mapping[str, dict] = field(default_factory=dict)
    tuning: tuple = ()
    timing: Mapping[str, float] = field(default_factory=dict)
    gradients: tuple = ()
    nhwc_inputs: frozenset[int] = frozenset()
    padded_images: Mapping[int, int] = field(default_factory=dict)
    backward: BackwardPlan | None = None


_UNLOWERED = Lowering(backend="reference", status="fused")
_NO_BACKWARD = BackwardPlan()


def _record(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.lowering or _UNLOWERED, name), doc=doc)


def _planned(name: str, doc: str) -> property:
    return property(lambda self: getattr((self.lowering or _UNLOWERED).backward or _NO_BACKWARD,
                                         name), doc=doc)


_read_hook: Callable[[tuple], None] | None = None


def set_read_hook(hook: Callable[[tuple], None] | None) -> None:
    """Call ``hook(inputs)`` before every region runs (the runtime's, which orders a CUDA graph's
    derivation before the first region that reads a derived weight:
    :func:`fusion_compiler.runtime.weight_cache.note_reads`)."""
    global _read_hook
    _read_hook = hook


class Region(torch.nn.Module):
    """A fused region (see module docstring).

    Attributes:
        region_id: ``"r0"``, ``"r1"``, ... in graph order.
        graph_module: the region's canonical ops as an fx graph.
        nodes: names of the nodes of the normalized graph that the region absorbed.
        space_to_depth: the block size when the region's prologue is a SpaceToDepth of its image
            (the fusion pass ``space_to_depth_stem``), else 0.
        lowering: the :class:`Lowering` record, ``None`` until lowered. Read through the
            properties below (``backend`` is ``"reference"`` and ``status`` ``"fused"`` before).
    """

    def __init__(self, region_id: str, graph_module: fx.GraphModule, nodes: list[str],
                 space_to_depth: int = 0):
        super().__init__()
        self.region_id = region_id
        self.graph_module = graph_module
        self.nodes = nodes
        self.space_to_depth = space_to_depth
        self.lowering: Lowering | None = None

    def set_lowering(self, record: Lowering) -> None:
        """Record what lowering made of the region.

        Raises:
            RuntimeError: the region has a record already (lowering writes it once).
        """
        if self.lowering is not None:
            raise RuntimeError(f"region {self.region_id} is lowered already")
        self.lowering = record

    backend = _record("backend", "The backend that runs the region.")
    status = _record("status", "``fused`` before lowering, then ``lowered`` or ``fallback``.")
    reason = _record("reason", "Why the region fell back, else ``''``.")
    plan = _record("plan", "The execution plan's name.")
    plan_from_cache = _record("plan_from_cache", "Whether the plan came from the disk cache.")
    workspace_bytes = _record("workspace_bytes", "The plan's workspace in bytes, or ``None``.")
    tuning = _record("tuning", "The plans autotuning timed.")
    timing = _record("timing", "ms per call of each candidate backend that was timed.")
    gradients = _record("gradients", "How each piece of a training region's backward runs.")
    nhwc_inputs = _record("nhwc_inputs", "Inputs the kernel reads channels_last.")
    padded_images = _record("padded_images", "Inputs the kernel zero-pads: position -> channels.")
    no_grad_inputs = _planned("no_grad_inputs", "Inputs that never need a gradient.")
    dgrad_drelu = _planned("dgrad_drelu", "Whether the dgrad applies the producer's ReLU backward.")
    dgrad_drelu_reason = _planned("dgrad_drelu_reason", "Why the dgrad does not, else ``''``.")
    masked_outputs = _planned("masked_outputs", "ReLU outputs whose gradient arrives masked.")

    @property
    def cudnn_graph(self) -> dict | None:
        """The cuDNN graph JSON of the region, when the frontend could build it."""
        return (self.lowering or _UNLOWERED).graphs.get("cudnn")

    @property
    def kernel(self) -> Callable[..., Any]:
        """What runs the region: the lowered kernel, or the region's own graph module."""
        kernel = (self.lowering or _UNLOWERED).kernel
        return self.graph_module if kernel is None else kernel

    def forward(self, *inputs: torch.Tensor):
        # not while Dynamo traces: the hook reads thread state Dynamo would guard on (and
        # recompile inside a CUDA graph capture); a compiled graph's regions run as the
        # ``run_region`` op, whose implementation calls the hook
        if _read_hook is not None and not torch.compiler.is_dynamo_compiling():
            _read_hook(inputs)
        return self.kernel(*inputs)

    # ------------------------------------------------------------------ structure
    @property
    def conv(self) -> fx.Node:
        """The region's convolution node (exactly one, checked by the verify pass)."""
        return next(n for n in self.graph_module.graph.nodes if is_conv(n))

    @property
    def conv_input_placeholder(self) -> fx.Node:
        """The placeholder the convolution's input comes from (through its prologue, following
        each op's first argument)."""
        node = self.conv.args[0]
        while node.op != "placeholder":
            node = node.args[0]
        return node

    @property
    def output_nodes(self) -> list[fx.Node]:
        out = next(n for n in self.graph_module.graph.nodes if n.op == "output")
        values = out.args[0]
        return list(values) if isinstance(values, (tuple, list)) else [values]

    def output_specs(self) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
        """``(shape, stride, dtype)`` of each output as traced (what ``register_kernel`` takes for
        a kernel that returns the graph's own tensors)."""
        return [(tuple(n.meta["val"].shape), tuple(n.meta["val"].stride()), n.meta["val"].dtype)
                for n in self.output_nodes]

    @property
    def pattern(self) -> str:
        """Readable op sequence, e.g. ``[add] conv3x3 > add > relu + sum_hw``: bracketed ops are the
        prologue (on the conv input), ``>`` chains the epilogue, ``+`` an exit reduction."""
        conv = self.conv
        prologue, epilogue, reductions, seen_conv = [], [], [], False
        for n in self.graph_module.graph.nodes:
            if n.op not in ("call_function", "call_method"):
                continue
            if n is conv:
                seen_conv = True
            elif is_hw_sum(n):
                reductions.append(op_name(n))
            else:
                (epilogue if seen_conv else prologue).append(op_name(n))
        if self.space_to_depth:  # the SpaceToDepth's view, permutes and reshapes
            prologue = [f"space_to_depth{self.space_to_depth}"]
        text = (f"[{' > '.join(prologue)}] " if prologue else "") + op_name(conv)
        text += "".join(f" > {op}" for op in epilogue)
        return text + "".join(f" + {r}" for r in reductions)

    def operands(self) -> list[Operand]:
        """The region inputs in call order, with their roles (see :class:`Operand`)."""
        conv = self.conv
        result = []
        for ph in self.graph_module.graph.nodes:
            if ph.op != "placeholder":
                continue
            val = ph.meta["val"]
            role = "image"
            for user in ph.users:
                if user is conv:
                    role = "image" if user.args[0] is ph else "weight"
                elif user.target in BINARY and user.args[0] is not ph:
                    # classified against the chain value it meets: conv input or conv output
                    role = operand_kind(tuple(val.shape), tuple(user.meta["val"].shape)) or "other"
            result.append(Operand(ph.name, role, tuple(val.shape), tuple(val.stride()), val.dtype))
        return result

    def describe(self) -> dict:
        """A JSON-ready summary: id, pattern, absorbed nodes, operands, outputs, backend, status,
        reason, execution plan and workspace (bytes), the candidate backends' times (ms), the
        cuDNN graph JSON and how each backward piece runs."""
        return {
            "id": self.region_id,
            "pattern": self.pattern,
            "nodes": list(self.nodes),
            "inputs": [{"name": o.name, "role": o.role, "shape": list(o.shape),
                        "dtype": str(o.dtype).removeprefix("torch.")} for o in self.operands()],
            "outputs": [{"name": n.name, "shape": list(n.meta["val"].shape)} for n in self.output_nodes],
            "backend": self.backend,
            "status": self.status,
            "reason": self.reason,
            "plan": self.plan,
            "plan_from_cache": self.plan_from_cache,
            "workspace_bytes": self.workspace_bytes,
            "timing_ms": dict(self.timing),
            "cudnn_graph": self.cudnn_graph,
            "gradients": [dict(vars(p)) for p in self.gradients],
        }


def called_region(gm: fx.GraphModule, node: object) -> Region | None:
    """The :class:`Region` that ``node`` of ``gm`` calls (a ``call_module`` node), or ``None``."""
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if isinstance(module, Region) else None
