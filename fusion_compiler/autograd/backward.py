"""The backward of a fused region: what its forward saves and how its gradients are computed.

A region is ``[prologue] conv > epilogue [+ sum_hw]`` (:mod:`fusion_compiler.ir.region`). Its
backward is reverse-mode differentiation of that graph, rule by rule, in reverse node order:

======================  =================================================================
op                      gradient rule (``g``: gradient of the op's output)
======================  =================================================================
``add(a, b)``           ``ga = g``; ``gb = g`` summed to ``b``'s shape (a scalar or per-channel
                        bias gets the sum of ``g`` over the broadcast dimensions)
``sub(a, b)``           ``ga = g``; ``gb = -g`` summed likewise
``mul(a, b)``           ``ga = g * b``; ``gb = g * a`` summed to ``b``'s shape (but see below)
``div(a, b)``           ``ga = g / b``; ``gb = -sum(g * a / b^2)``
``relu``                ``g * (y > 0)`` from the saved output ``y`` (``threshold_backward``)
``clamp(x, lo, hi)``    ``g * (lo <= x <= hi)`` from the saved input
``sigmoid``/``tanh``    ``g * y * (1 - y)`` / ``g * (1 - y^2)`` from the saved output
``silu``                ``g * s * (1 + x * (1 - s))``, ``s = sigmoid(x)``, from the saved input
``sum_hw``              ``g`` broadcast over H, W (and cast to the summed value's dtype: a
                        half-precision sum accumulates in fp32, ``dtype=torch.float32``)
``conv2d``              dgrad ``dx = conv_dgrad(g, w)`` and wgrad ``dw = conv_wgrad(x, g)``
======================  =================================================================

A ``mul`` right after the convolution by a scalar or per-channel operand ``s`` (the Fixup scale,
a folded batch-norm scale) is folded into the convolution's weight gradients: with ``g`` the
gradient of ``y * s``, ``wgrad(x, g * s) = wgrad(x, g) * s`` and
``ds_k = sum(g_k * y_k) = sum_{c,r,s}(w ⊙ wgrad(x, g))_k`` (the adjoint of the convolution), so
the conv output need not be saved. The data gradient stays ``dgrad(g * s, w)``, rounded per
element as eager rounds it: the equal ``dgrad(g, fp16(w * s))`` rounds each weight once for every
position, a coherent error that does not average out in the sums of the scalar-bias gradients
upstream. What error remains in those gradients comes from the scalar's conditioning, not from
this backward (measurements: docs/decisions.md, "The Fixup scale folded into the backward").
Under ``glue_backend="inductor"`` the ``g * s`` fuses with the pointwise op producing ``g``.

When the convolution's input is the output of a ReLU in another region, read by nothing else
(:func:`fusion_compiler.autograd.plan.backward_plans`), the dgrad applies that ReLU's backward
(``ConvGradients.dgrad_drelu``: one cuDNN graph ``conv_dgrad > relu_backward``) and the producing
region's ``relu`` rule passes the gradient through (``region.masked_outputs``).

Values the rules read after the convolution (the conv output before a ``mul``, a ReLU output the
chain goes on from) are saved: :func:`training_region` makes them extra region outputs, so a cuDNN
forward graph writes them in the same pass (virtual tensors become outputs). Prologue values
(pointwise ops on the region inputs) are recomputed in the backward instead. Gradients are only
computed for inputs that need them (a frozen weight gets no wgrad, a network input no dgrad).

The convolution's dgrad and wgrad come from a :class:`ConvGradients`: PyTorch's
``aten.convolution_backward`` (:class:`TorchConvGradients`) or cuDNN graphs
(:class:`fusion_compiler.backends.cudnn.backward.CudnnConvGradients`); the pointwise rules
run as PyTorch ops.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ir.ops import is_conv, is_hw_sum
from ..ir.region import Region
from ..runtime.tensors import layout_like

__all__ = ["ConvGradients", "TorchConvGradients", "RegionBackward", "saved_nodes",
           "training_region", "folded_scale"]

aten = torch.ops.aten


class ConvGradients(Protocol):
    """dgrad and wgrad of one region's convolution (NCHW-logical tensors, any layout).

    ``dgrad(dy, x, w) -> dx`` with ``dy: [N,K,P,Q]``, ``x: [N,C,H,W]`` (only its shape is read),
    ``w: [K,C/groups,R,S]``, returns ``[N,C,H,W]``; ``wgrad(dy, x, w) -> dw`` returns
    ``[K,C/groups,R,S]``. Both in the dtype of ``dy``.
    """

    def dgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def dgrad_drelu(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dgrad(dy, x, w) * (x > 0)``: the dgrad with the backward of the ReLU whose output
        is ``x`` (``x`` is read)."""
        ...

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...


class TorchConvGradients:
    """dgrad/wgrad with PyTorch's ``aten.convolution_backward`` (cuDNN's or the CPU's own
    kernels, as eager autograd uses them) for the convolution node ``conv``."""

    differentiable = True
    """``aten.convolution_backward`` has a derivative of its own: a backward through these
    gradients (``create_graph=True``) is eager's."""

    def __init__(self, conv: fx.Node):
        _, _, _, self.stride, self.padding, self.dilation, self.groups = conv.args

    def _backward(self, dy, x, w, mask):
        return aten.convolution_backward(dy, x, w, None, list(self.stride), list(self.padding),
                                         list(self.dilation), False, [0, 0], self.groups, mask)

    def dgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._backward(dy, x, w, [True, False, False])[0]

    def dgrad_drelu(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return aten.threshold_backward(self.dgrad(dy, x, w), x, 0)

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._backward(dy, x, w, [False, True, False])[1]


def folded_scale(region: Region) -> fx.Node | None:
    """The ``mul(conv, s)`` node whose scale folds into the convolution's backward (see module
    docstring): the conv's only user, ``s`` a number or a scalar/per-channel tensor."""
    conv = region.conv
    users = list(conv.users)
    if len(users) != 1 or users[0].target is not torch.mul or users[0].args[0] is not conv:
        return None
    s = users[0].args[1]
    if isinstance(s, (int, float)):
        return users[0]
    k = conv.meta["val"].shape[1]
    if isinstance(s, fx.Node) and s is not conv and s.meta["val"].numel() in (1, k):
        shape = (1,) * (4 - s.meta["val"].dim()) + tuple(s.meta["val"].shape)
        if shape in ((1, 1, 1, 1), (1, k, 1, 1)):
            return users[0]
    return None


def _reads(node: fx.Node, folded: fx.Node | None = None) -> list[fx.Node]:
    """The values ``node``'s gradient rule reads (its own output counts as ``node``)."""
    if node is folded:  # the conv's inputs and the scale, never the conv output
        conv = node.args[0]
        return [a for a in (*conv.args[:2], node.args[1]) if isinstance(a, fx.Node)]
    if node.target in (torch.mul, torch.div):
        return [a for a in node.args if isinstance(a, fx.Node)] + (
            [node] if node.target is torch.div else [])
    if node.target in (torch.relu, torch.sigmoid, torch.tanh):
        return [node]
    if node.target is torch.clamp or node.target is F.silu or is_conv(node):
        return [a for a in node.args[:2] if isinstance(a, fx.Node)]
    return []


def _after_conv(region: Region) -> set[fx.Node]:
    conv, seen, result = region.conv, False, set()
    for n in region.graph_module.graph.nodes:
        seen = seen or n is conv
        if seen and n.op not in ("placeholder", "output"):
            result.add(n)
    return result


def saved_nodes(region: Region) -> list[fx.Node]:
    """Values at or after the convolution that the backward reads and the region does not
    already return, in graph order: the extra outputs of :func:`training_region`."""
    after, outputs = _after_conv(region), set(region.output_nodes)
    folded = folded_scale(region)
    needed = {v for n in region.graph_module.graph.nodes if n.op == "call_function"
              for v in _reads(n, folded)}
    return [n for n in region.graph_module.graph.nodes
            if n in needed and n in after and n not in outputs]


def training_region(region: Region) -> Region:
    """A copy of ``region`` that also returns :func:`saved_nodes` (after its own outputs, so the
    indices callers read are unchanged)."""
    extra = saved_nodes(region)
    if not extra:
        return region
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in region.graph_module.graph.nodes:
        if n.op != "output":
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in (*region.output_nodes, *extra)))
    return Region(region.region_id, fx.GraphModule(region.graph_module, graph), list(region.nodes))


def _value(node: Any, values: dict[fx.Node, Any]) -> Any:
    """``node``'s value: from ``values``, or recomputed from its inputs (a prologue value)."""
    if not isinstance(node, fx.Node):
        return node
    if node not in values:
        values[node] = node.target(*(_value(a, values) for a in node.args), **node.kwargs)
    return values[node]


def _sum_to(g: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``g`` summed over the dimensions an operand of ``shape`` was broadcast along."""
    return g.sum_to_size(tuple(shape)) if tuple(g.shape) != tuple(shape) else g


class RegionBackward:
    """The backward of a training region (see module docstring); the ``backward`` callable that
    :func:`fusion_compiler.runtime.region_op.register_backward` takes.

    Args:
        region: a region from :func:`training_region` (its outputs include the saved values).
        conv_grads: dgrad/wgrad of the region's convolution.
    """

    def __init__(self, region: Region, conv_grads: ConvGradients):
        self.region = region
        self.conv_grads = conv_grads
        graph = region.graph_module.graph
        self.placeholders = list(graph.find_nodes(op="placeholder"))
        self.outputs = region.output_nodes
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.folded = folded_scale(region)
        after = _after_conv(region)
        missing = [v.name for n in self.nodes if n in after for v in _reads(n, self.folded)
                   if v in after and v not in self.outputs]
        if missing:
            raise ValueError(f"region {region.region_id} does not return {missing}, which its "
                             f"backward reads: build it with training_region()")
        self._wanted: dict[tuple[bool, ...], frozenset[fx.Node]] = {}

    @property
    def differentiable(self) -> bool:
        """Whether a backward through this backward's gradients is right: its pointwise rules
        are PyTorch ops, so when its dgrad and wgrad are too (:class:`TorchConvGradients`)."""
        return getattr(self.conv_grads, "differentiable", False)

    def _wanted_nodes(self, needs_grad: Sequence[bool]) -> frozenset[fx.Node]:
        """The inputs that need a gradient and every node whose gradient leads to one; computed
        once per ``needs_grad`` pattern (the backward runs every training step)."""
        key = tuple(needs_grad)
        if key not in self._wanted:
            wanted = {ph for ph, need in zip(self.placeholders, key) if need}
            for n in self.nodes:
                if any(a in wanted for a in n.all_input_nodes):
                    wanted.add(n)
            self._wanted[key] = frozenset(wanted)
        return self._wanted[key]

    def __call__(self, needs_grad: Sequence[bool], inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor | None]
                 ) -> list[torch.Tensor | None]:
        """Gradients of the region inputs (``None`` where ``needs_grad`` is False).

        Args:
            needs_grad: one bool per region input.
            inputs, outputs: what the forward read and returned (saved values included).
            grad_outputs: one gradient per output, ``None`` for an output nothing read.
        """
        values: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        for node, out in zip(self.outputs, outputs):
            values.setdefault(node, out)
        wanted = self._wanted_nodes(needs_grad)

        # Not a recursive closure: one that calls itself is a reference cycle, which kept the
        # saved tensors (and through them the autograd graph) alive until the cyclic GC ran.
        def value(node: Any) -> Any:
            return _value(node, values)

        grads: dict[fx.Node, torch.Tensor] = {}

        def accumulate(node: Any, g: torch.Tensor) -> None:
            if isinstance(node, fx.Node) and node in wanted:
                val = node.meta["val"]  # a gradient has its value's dtype (an fp32 sum's is fp32)
                g = _sum_to(g, val.shape).to(val.dtype)
                grads[node] = g if node not in grads else grads[node] + g

        for node, g in zip(self.outputs, grad_outputs):
            if g is not None:
                if g.dim() == 4:  # one layout for every pointwise rule (cuDNN writes NHWC)
                    g = g.contiguous(memory_format=torch.channels_last)
                accumulate(node, g)
        for node in reversed(self.nodes):
            g = grads.pop(node, None)
            if g is not None:
                self._rule(node, g, value, accumulate, wanted)
        result: list[torch.Tensor | None] = []
        for ph, x in zip(self.placeholders, inputs):
            g = grads.get(ph)
            result.append(None if g is None else layout_like(g.to(x.dtype).reshape(x.shape), x))
        return result

    def _dgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.region.dgrad_drelu:
            return self.conv_grads.dgrad_drelu(dy, x, w)
        return self.conv_grads.dgrad(dy, x, w)

    def _folded_rule(self, node: fx.Node, g: torch.Tensor, value, accumulate, wanted) -> None:
        """Backward of ``conv > mul(s)`` with ``s`` folded into the weight gradients."""
        conv, s = node.args
        x, w = conv.args[0], conv.args[1]
        scale = value(s)
        if isinstance(scale, torch.Tensor):
            scale = scale.reshape(-1, 1, 1, 1).to(g.dtype)  # [K|1, 1, 1, 1] against w [K,C,R,S]
        weight = value(w)
        if x in wanted:
            per_channel = scale.reshape(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale
            accumulate(x, self._dgrad(g * per_channel, value(x), weight))
        if w in wanted or s in wanted:
            raw = self.conv_grads.wgrad(g, value(x), weight)
            if w in wanted:
                accumulate(w, raw * scale)
            if s in wanted:
                acc = torch.promote_types(raw.dtype, torch.float32)  # fp16/bf16 sum in fp32
                per_k = (raw.to(acc) * weight.to(acc)).sum(dim=(1, 2, 3))
                shape = s.meta["val"].shape
                accumulate(s, (per_k.sum() if s.meta["val"].numel() == 1 else per_k).reshape(shape))

    def _rule(self, node: fx.Node, g: torch.Tensor, value, accumulate, wanted) -> None:
        target, args = node.target, node.args
        if node is self.folded:
            self._folded_rule(node, g, value, accumulate, wanted)
        elif is_conv(node):
            x, w = args[0], args[1]
            if x in wanted:
                accumulate(x, self._dgrad(g, value(x), value(w)))
            if w in wanted:
                accumulate(w, self.conv_grads.wgrad(g, value(x), value(w)))
        elif target is torch.add:
            accumulate(args[0], g)
            accumulate(args[1], g)
        elif target is torch.sub:
            accumulate(args[0], g)
            if args[1] in wanted:
                accumulate(args[1], -g)
        elif target is torch.mul:
            a, b = args
            if a in wanted:
                accumulate(a, g * value(b))
            if b in wanted:
                accumulate(b, g * value(a))
        elif target is torch.div:
            a, b = args
            if a in wanted:
                accumulate(a, g / value(b))
            if b in wanted:
                accumulate(b, -g * value(node) / value(b))
        elif target is torch.relu:
            if node.name in self.region.masked_outputs:  # the consumer's dgrad masked it
                accumulate(args[0], g)
            else:
                accumulate(args[0], aten.threshold_backward(g, value(node), 0))
        elif target is torch.clamp:
            x = value(args[0])
            lo, hi = args[1], args[2]
            accumulate(args[0], torch.where((x >= lo) & (x <= hi), g, 0))
        elif target is torch.sigmoid:
            accumulate(args[0], aten.sigmoid_backward(g, value(node)))
        elif target is torch.tanh:
            accumulate(args[0], aten.tanh_backward(g, value(node)))
        elif target is F.silu:
            accumulate(args[0], aten.silu_backward(g, value(args[0])))
        elif is_hw_sum(node):
            accumulate(args[0], g.expand(node.args[0].meta["val"].shape))
        else:  # pragma: no cover - the fuse pass admits only the ops above
            raise NotImplementedError(f"no gradient rule for {node.target}")
