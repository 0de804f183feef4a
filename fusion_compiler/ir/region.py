"""A fused region: one convolution with its prologue, epilogue and optional exit reduction.

In the fused graph each region is a ``call_module`` node whose module is a :class:`Region`. The
region's own ``torch.fx.GraphModule`` (``region.graph_module``) holds the canonical ops of
:mod:`fusion_compiler.ops`; its placeholders are the region inputs (activations, the weight,
scalar/per-channel/full-tensor operands) and it returns a tuple of outputs (the chain's last
value, intermediates other nodes still read, and the reduction if any).

Lowering sets ``region.kernel`` (through ``set_kernel``) (a callable with the same signature as
``graph_module``) and ``region.backend``/``status``/``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from .ops import BINARY, is_conv, is_hw_sum, op_name

__all__ = ["Region", "Operand", "operand_kind", "called_region"]


def operand_kind(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> str | None:
    """Classify a pointwise operand by its broadcast shape against the conv output ``[N,K,P,Q]``.

    Returns ``"scalar"`` (``[1,1,1,1]``, any 1-element shape), ``"channel"`` (``[1,K,1,1]``),
    ``"spatial"`` (``[N,1,P,Q]``), ``"full"`` (``[N,K,P,Q]``), ``"sample_channel"`` (``[N,K,1,1]``,
    which cuDNN's runtime fusion engines do not take as an epilogue operand, see CUDNN_FACTS.md) or
    ``None`` for anything else.
    """
    if len(shape) > 4:
        return None
    s = (1,) * (4 - len(shape)) + tuple(shape)
    n, k, p, q = out_shape
    if all(d == 1 for d in s):
        return "scalar"
    return {(1, k, 1, 1): "channel", (n, 1, p, q): "spatial", (n, k, p, q): "full",
            (n, k, 1, 1): "sample_channel"}.get(s)


@dataclass(frozen=True)
class Operand:
    """One region input: ``role`` is ``image``, ``weight``, ``scalar``, ``channel``, ``spatial`` or
    ``full``; ``shape``/``stride`` in elements; ``dtype`` a ``torch.dtype``."""

    name: str
    role: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class Region(torch.nn.Module):
    """A fused region (see module docstring).

    Attributes:
        region_id: ``"r0"``, ``"r1"``, ... in graph order.
        graph_module: the region's canonical ops as an fx graph.
        nodes: names of the nodes of the normalized graph that the region absorbed.
        plan, plan_from_cache, workspace_bytes: the cuDNN execution plan's name, whether it came
            from the on-disk cache, and its workspace in bytes (``None`` off cuDNN).
        backend, status, reason: what lowering decided (``status`` is ``"fused"`` before lowering,
            then ``"lowered"`` or ``"fallback"``; ``reason`` says why a fallback happened).
        kernel: the callable that runs the region (set with :meth:`set_kernel`); the reference
            backend's is ``graph_module`` itself.
        cudnn_graph: the cuDNN graph JSON (dict) when it could be built, else ``None``.
        tuning: the plans autotuning built and timed (``PlanTiming`` list, ranked order); empty
            when the plan came from the cache or autotuning was off.
        timing: ``{"cudnn_ms", "pytorch_ms"}``: the lowered kernel against the region's PyTorch
            ops on the GPU (ms per call, CUDA-graph timing); empty when not measured.
        gradients: in a training specialization lowered to cuDNN, how each piece of the backward
            runs (``GradientPiece`` list: dgrad, wgrad); empty otherwise (PyTorch autograd).
        no_grad_inputs: names of region inputs known never to need a gradient (network inputs
            that do not require grad); set by lowering in training.
        dgrad_drelu, dgrad_drelu_reason: in training, whether the convolution's dgrad is fused
            with the ReLU backward of the region producing its input, and why not
            (:func:`fusion_compiler.lowering.plan_dgrad_drelu`).
        masked_outputs: names of ReLU output nodes whose gradient arrives already masked (the
            consuming region's dgrad applied the ReLU backward): the backward passes it through.
        nhwc_inputs: positions of the inputs the kernel reads as fully packed channels_last
            activations: those a cuDNN kernel converts when they arrive otherwise, or, for a
            region left to PyTorch because its ops timed faster, the activations it was timed on
            as channels_last. :func:`fusion_compiler.runtime.layout.channels_last_activations`
            makes the graph hand them so.
        padded_images: ``{position: channels}``: inputs a cuDNN kernel zero-pads to more
            channels (channels_last) before its plan runs, and takes as they come when they
            arrive so (:func:`fusion_compiler.runtime.layout.channel_padded_images`).
        stream: ``"side"`` when the region runs on the side stream beside a longer branch
            (:func:`fusion_compiler.runtime.streams.run_short_branches_beside`), else ``""``.
        space_to_depth: the block size when the region's prologue is a SpaceToDepth of its image
            (:func:`fusion_compiler.runtime.space_to_depth.space_to_depth_stems`), else 0.
    """

    def __init__(self, region_id: str, graph_module: fx.GraphModule, nodes: list[str]):
        super().__init__()
        self.region_id = region_id
        self.graph_module = graph_module
        self.nodes = nodes
        self.backend = "reference"
        self.status = "fused"
        self.reason = ""
        self.cudnn_graph: dict | None = None
        self.tuning: list = []
        self.timing: dict[str, float] = {}
        self.plan: str = ""
        self.plan_from_cache: bool | None = None
        self.workspace_bytes: int | None = None
        self.gradients: list = []
        self.no_grad_inputs: set[str] = set()
        self.dgrad_drelu = False
        self.dgrad_drelu_reason = ""
        self.masked_outputs: set[str] = set()
        self.nhwc_inputs: frozenset[int] = frozenset()
        self.padded_images: dict[int, int] = {}
        self.stream = ""
        self.space_to_depth = 0
        self._lowered: Callable[..., Any] | None = None  # None: run graph_module itself

    @property
    def kernel(self) -> Callable[..., Any]:
        return self.graph_module if self._lowered is None else self._lowered

    def set_kernel(self, fn: Callable[..., Any]) -> None:
        """Run ``fn`` from now on (kept out of nn.Module's registry: a kernel is a callable)."""
        self.__dict__["_lowered"] = None if fn is self.graph_module else fn

    def forward(self, *inputs: torch.Tensor):
        return self.kernel(*inputs)

    # ------------------------------------------------------------------ structure
    @property
    def conv(self) -> fx.Node:
        """The region's convolution node (exactly one, checked by the verify pass)."""
        return next(n for n in self.graph_module.graph.nodes if is_conv(n))

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
        reason, execution plan and workspace (bytes), cuDNN graph JSON."""
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
            "stream": self.stream,
            "cudnn_graph": self.cudnn_graph,
            "gradients": [dict(vars(p)) for p in self.gradients],
        }


def called_region(gm: fx.GraphModule, node: object) -> Region | None:
    """The :class:`Region` that ``node`` of ``gm`` calls (a ``call_module`` node), or ``None``."""
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if isinstance(module, Region) else None
