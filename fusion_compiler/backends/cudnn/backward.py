"""cuDNN graphs for a region's convolution backward: dgrad and wgrad.

* dgrad: ``dx[N,C,H,W] = conv_dgrad(dy[N,K,P,Q], w[K,C/g,R,S])``;
* dgrad_drelu: ``dx = relu_backward(conv_dgrad(dy, w), x)`` = ``dgrad * (x > 0)``, for a
  convolution whose input ``x[N,C,H,W]`` is another region's ReLU output
  (:func:`fusion_compiler.autograd.plan.backward_plans`); the ``dgrad`` stays virtual. cuDNN
  fuses it for stride 1 only (docs/cudnn.md, "Runtime-fusion support surface (SM 9.0)"). Fused,
  it is faster than PyTorch's dgrad then ``threshold_backward``; the mask costs one more read of
  ``x`` than the dgrad alone (measurements: docs/decisions.md, "dgrad fused with the ReLU
  backward");
* wgrad: ``dw[K,C/g,R,S] = conv_wgrad(x[N,C,H,W], dy[N,K,P,Q])``, written in the I/O type: with an
  fp32 output cuDNN picked a much slower engine (measurements: docs/decisions.md, "wgrad written
  in fp16").

All follow the forward's conventions (:mod:`.graph`): fully packed NHWC tensors, fp32 compute,
alpha = 1 and beta = 0 (the autograd engine adds gradients that meet). The pointwise part of a
region's backward (:mod:`fusion_compiler.autograd.backward`) runs as PyTorch ops.

While ``torch.compile`` traces a backward (``compile(model, glue_backend=...)``: AOTAutograd
traces the region's backward formula), each piece is called through the
``fusion_compiler::run_region`` custom op, so the traced graph holds an opaque call with known
output shape and strides; run eagerly it executes the plan directly (no dispatcher overhead).

Each graph is built into a :class:`~.plan.CudnnPlan` (cached, autotuned). When autotuning is on,
each is also timed against PyTorch's ``convolution_backward`` (then ``threshold_backward`` for
dgrad_drelu) on random data of its shapes, the two timed alternately
(:func:`~fusion_compiler.backends.timing.paired_time_ms`), and PyTorch's ops run instead when
they were faster: no gradient graph is kept that timed slower than the ops it replaces (the timing
is cached with the plan, see ``CudnnPlan.timed_against_pytorch``). Unlike a region's forward
graph, there is no 10% margin for PyTorch to clear (``PYTORCH_MARGIN``): both sides do the same
work on the same layouts, the weight aside, which each side gets as it has it at run time. A graph
cuDNN rejects runs on PyTorch with cuDNN's reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...autograd.backward import RegionBackward, TorchConvGradients
from ...ir.ops import node_device
from ...ir.errors import UnsupportedError, condense
from ...ir.region import BackwardPlan, Region
from ...runtime.region_op import is_traced, register_backward, register_kernel, run_region
from ..timing import paired_time_ms, sample_tensor
from .graph import channel_padding, import_cudnn, recipe_dtype, to_nhwc
from ...runtime.weight_cache import WeightCache
from .plan import CudnnPlan
from .recipe import CudnnGraph, build_pygraph, nhwc_strides

__all__ = ["conv_grad_recipe", "conv_grad_graph", "CudnnConvGradients", "GradientPiece", "GRADIENT_KINDS",
           "register_cudnn_backward",
           "GRAPH_INPUTS"]

GRADIENT_KINDS = ("dgrad", "dgrad_drelu", "wgrad")

#: The tensors each graph of :func:`conv_grad_graph` reads, in its input order (the order of the
#: ``run_region`` op's inputs too).
GRAPH_INPUTS = {"dgrad": ("dy", "w"), "dgrad_drelu": ("dy", "w", "x"), "wgrad": ("x", "dy")}


def _shape(node: Any) -> list[int]:
    return list(node.meta["val"].shape)


def conv_grad_recipe(kind: str, conv: fx.Node) -> dict:
    """The dgrad (``kind="dgrad"``), dgrad_drelu or wgrad (``"wgrad"``) graph of convolution
    node ``conv`` (see module docstring) as a recipe (:mod:`.recipe`).

    Inputs as ``GRAPH_INPUTS[kind]`` names them: dgrad ``(dy, w)``, dgrad_drelu ``(dy, w, x)``,
    wgrad ``(x, dy)``; one output (``dx`` or ``dw``).

    Raises:
        UnsupportedError: the dtype is not fp16/bf16/fp32.
        ValueError: ``kind`` is not one of ``GRADIENT_KINDS``.
    """
    if kind not in GRADIENT_KINDS:
        raise ValueError(f"kind must be one of {GRADIENT_KINDS}, got {kind!r}")
    _, _, _, stride, padding, dilation, _groups = conv.args
    io = recipe_dtype(conv.meta["val"].dtype)
    dims = {"dy": _shape(conv), "x": _shape(conv.args[0]), "w": _shape(conv.args[1])}
    inputs = [{"name": name, "dim": dims[name], "stride": nhwc_strides(dims[name]), "dtype": io,
               "batched": name != "w"} for name in GRAPH_INPUTS[kind]]
    attrs = {"padding": list(padding), "stride": list(stride), "dilation": list(dilation)}
    if kind == "wgrad":
        ops = [{"op": "conv_wgrad", "name": "wgrad", "args": {"image": "x", "loss": "dy"},
                "attrs": attrs}]
        out_dims = dims["w"]
    else:
        ops = [{"op": "conv_dgrad", "name": "dgrad", "args": {"loss": "dy", "filter": "w"},
                "attrs": attrs}]
        out_dims = dims["x"]
        if kind == "dgrad_drelu":
            ops[0]["out"] = {"dim": out_dims, "stride": nhwc_strides(out_dims), "batched": True}
            ops.append({"op": "relu_backward", "name": "drelu",
                        "args": {"loss": "dgrad", "input": "x"}})
    outputs = [{"ref": ops[-1]["name"], "dim": out_dims, "stride": nhwc_strides(out_dims),
                "dtype": io, "batched": kind != "wgrad"}]
    return {"io": io, "inputs": inputs, "ops": ops, "outputs": outputs}


def conv_grad_graph(kind: str, conv: fx.Node, handle: Any = None) -> CudnnGraph:
    """The ``cudnn.pygraph`` of :func:`conv_grad_recipe` (no GPU needed).

    Raises:
        UnsupportedError: the frontend is missing or the dtype is not fp16/bf16/fp32.
        ValueError: ``kind`` is not one of ``GRADIENT_KINDS``.
    """
    recipe = conv_grad_recipe(kind, conv)
    import_cudnn()
    return build_pygraph(recipe, handle)


@dataclass
class GradientPiece:
    """How one piece of a region's backward runs: ``kind`` is one of ``GRADIENT_KINDS``;
    ``backend`` is ``"cudnn"`` or ``"pytorch"``; ``reason`` says why PyTorch (cuDNN's own message,
    or both timings); ``note`` why a dgrad does not include the ReLU backward; ``cudnn_ms`` and
    ``pytorch_ms`` are per call (CUDA-graph timing, input preparation included), ``None`` when
    not measured; ``plan`` is the cuDNN execution plan."""

    kind: str
    backend: str
    reason: str = ""
    note: str = ""
    plan: str = ""
    cudnn_ms: float | None = None
    pytorch_ms: float | None = None


class CudnnConvGradients:
    """dgrad/wgrad of one region's convolution on cuDNN (see module docstring).

    Args:
        backend: the :class:`~.backend.CudnnBackend` (handles, workspace, cache, autotune).
        region: the region (shapes from its nodes' ``meta["val"]``).
        backward: the region's backward plan (``dgrad_drelu``: the dgrad graph applies the ReLU
            backward of the region producing the convolution's input).
        skip: gradient kinds never needed (``"dgrad"`` when the conv input is a network input
            that needs no gradient); they are not built and compute through PyTorch if asked.
        weight_cache: the forward kernel's channels_last copy of the weight, so forward and dgrad
            share one copy per weight version (``None``: a cache of its own).

    ``pieces`` lists a :class:`GradientPiece` per kind.
    """

    def __init__(self, backend, region: Region, backward: BackwardPlan,
                 skip: frozenset[str] = frozenset(), weight_cache=None):
        conv = region.conv
        self.torch = TorchConvGradients(conv)
        self.device = node_device(conv)
        self.x_shape = tuple(_shape(conv.args[0]))
        self.w_shape = tuple(_shape(conv.args[1]))
        self.w_stride = tuple(conv.args[1].meta["val"].stride())  # the parameter's own layout
        self.y_shape = tuple(_shape(conv))
        self.dtype = conv.meta["val"].dtype
        self._weights = weight_cache if weight_cache is not None else WeightCache()
        self.plans: dict[str, Any] = {}
        self.pieces: list[GradientPiece] = []
        self._ops: dict[str, tuple[_GradientOp, int]] = {}  # kind -> (op kernel, run_region key)
        padded = channel_padding(region) is not None
        kinds = ("dgrad_drelu" if backward.dgrad_drelu else "dgrad", "wgrad")
        for kind in kinds:
            if kind.split("_")[0] in skip:
                self.pieces.append(GradientPiece(kind, "pytorch", "not needed (no input of it "
                                                 "requires grad)"))
                continue
            if padded:
                self.pieces.append(GradientPiece(kind, "pytorch", "the forward pads the input "
                                                 "channels for cuDNN; PyTorch computes this "
                                                 "convolution's gradients"))
                continue
            label = f"region {region.region_id} {kind}"
            try:
                plan = CudnnPlan(backend, self.device, conv_grad_recipe(kind, conv), label)
            except UnsupportedError as exc:
                self.pieces.append(GradientPiece(kind, "pytorch", condense(exc.reason)))
                continue
            self.plans[kind] = plan
            op = _GradientOp(self, kind)
            shape = self._out_shape(kind)
            self._ops[kind] = (op, register_kernel(op, [(shape, tuple(nhwc_strides(shape)),
                                                         self.dtype)], label))
            unfused = backward.dgrad_drelu_reason if kind == "dgrad" else ""
            piece = GradientPiece(kind, "cudnn", plan=plan.plan_name,
                                  note=f"relu_backward not fused: {unfused}" if unfused else "")
            if backend.autotune > 1:
                self._compare(piece)
            self.pieces.append(piece)

    def _compare(self, piece: GradientPiece) -> None:
        """Time the plan against PyTorch's ops on random data and keep the faster (cuDNN on a
        tie). Each side gets the weight as it has it at run time: cuDNN the channels_last copy
        its forward already made (``weight_cache``), PyTorch the parameter in its own layout,
        which ``convolution_backward`` converts on every call."""
        run_cudnn = functools.partial(self._cudnn, piece.kind)
        run_torch = getattr(self.torch, piece.kind)

        def measure() -> tuple[float, float]:
            dy, x, w = (sample_tensor(shape, self.dtype, self.device)
                        for shape in (self.y_shape, self.x_shape, self.w_shape))
            x = to_nhwc(x.relu()) if piece.kind == "dgrad_drelu" else x  # a ReLU output
            param = sample_tensor(self.w_shape, self.dtype, self.device, self.w_stride)
            cudnn_ms, torch_ms = paired_time_ms([lambda: run_cudnn(dy, x, w),
                                                 lambda: run_torch(dy, x, param)], reps=7)
            return cudnn_ms, torch_ms

        piece.cudnn_ms, piece.pytorch_ms = self.plans[piece.kind].timed_against_pytorch(
            measure, "paired_timing")
        if piece.pytorch_ms < piece.cudnn_ms:
            piece.backend = "pytorch"
            piece.reason = (f"PyTorch was faster on this GPU: {piece.pytorch_ms:.5f} ms against "
                            f"{piece.cudnn_ms:.5f} ms on cuDNN")
            del self.plans[piece.kind]
            del self._ops[piece.kind]

    # ------------------------------------------------------------------ ConvGradients
    def _out_shape(self, kind: str) -> tuple[int, ...]:
        return self.w_shape if kind == "wgrad" else self.x_shape

    def _cudnn(self, kind: str, dy, x, w) -> torch.Tensor:
        """Execute the plan of ``kind`` on the tensors it reads (``GRAPH_INPUTS``; the others
        may be ``None``), laid out as declared; returns its fresh channels_last output."""
        given = {"dy": dy, "x": x, "w": w}
        inputs = [self._weights(w) if name == "w" else to_nhwc(given[name])
                  for name in GRAPH_INPUTS[kind]]
        shape = self._out_shape(kind)
        out = torch.empty_strided(shape, nhwc_strides(shape), dtype=dy.dtype, device=dy.device)
        self.plans[kind].execute(inputs, [out])
        return out

    def _run(self, kind: str, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if kind not in self.plans:
            return getattr(self.torch, kind)(dy, x, w)
        if is_traced(dy):  # an opaque op with known output metadata in the traced graph
            given = {"dy": dy, "x": x, "w": w}
            return run_region(self._ops[kind][1], [given[n] for n in GRAPH_INPUTS[kind]])[0]
        return self._cudnn(kind, dy, x, w)

    def dgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dx`` (channels_last) from ``dy`` and ``w``; see ``ConvGradients``."""
        return self._run("dgrad", dy, x, w)

    def dgrad_drelu(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dx * (x > 0)`` (channels_last) from ``dy``, ``w`` and ``x``; see ``ConvGradients``."""
        return self._run("dgrad_drelu", dy, x, w)

    def wgrad(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``dw`` (channels_last) from ``x`` and ``dy``; see ``ConvGradients``."""
        return self._run("wgrad", dy, x, w)


def register_cudnn_backward(backend, region: Region, key: int, backward: BackwardPlan | None,
                            weight_cache: WeightCache | None = None) -> tuple[GradientPiece, ...]:
    """Make ``region``'s backward the backward of the ``run_region`` kernel ``key``: a
    :class:`~fusion_compiler.autograd.backward.RegionBackward` whose convolution gradients are
    :class:`CudnnConvGradients` (no dgrad when the convolution's input is in
    ``backward.no_grad_inputs``). Whichever backend runs the forward (a cuDNN plan, the Triton
    convolution) calls this, so the backward does not depend on that choice.

    Args:
        backend: the :class:`~.backend.CudnnBackend` that builds the gradient plans.
        region: a region from :func:`~fusion_compiler.autograd.backward.training_region`.
        key: the forward kernel's ``run_region`` key.
        backward: the region's backward plan (``None``: the default plan).
        weight_cache: the forward kernel's channels_last weight copy, shared with the dgrad.

    Returns:
        How each piece (dgrad, wgrad) runs, for the region's report.
    """
    backward = backward or BackwardPlan()
    image = region.conv_input_placeholder.name
    skip = frozenset({"dgrad"} if image in backward.no_grad_inputs else ())
    grads = CudnnConvGradients(backend, region, backward, skip, weight_cache=weight_cache)
    register_backward(key, RegionBackward(region, grads))
    return tuple(grads.pieces)


class _GradientOp:
    """A cuDNN dgrad, dgrad_drelu or wgrad as a kernel of the ``run_region`` op, whose inputs are
    only the tensors the graph reads (``GRAPH_INPUTS``), so a traced backward keeps no activation
    alive for a plain dgrad."""

    def __init__(self, grads: CudnnConvGradients, kind: str):
        self.grads, self.kind = grads, kind

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor]:
        named = dict(zip(GRAPH_INPUTS[self.kind], tensors))
        return (self.grads._cudnn(self.kind, named["dy"], named.get("x"), named.get("w")),)
