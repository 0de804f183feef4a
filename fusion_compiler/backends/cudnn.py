"""The cuDNN backend: each region runs as one cuDNN execution plan.

Per region (and so per shapes, strides, dtypes and device, since regions are specialized) it builds
the graph of :mod:`.cudnn_graph`, creates plans from heuristics A then FALLBACK, builds the first
plan that compiles (0.5-3 s on an H100, CUDNN_FACTS.md), and stores it in the on-disk
:class:`~fusion_compiler.runtime.plan_cache.PlanCache`. At run time it executes with one cuDNN
handle per device whose stream follows ``torch.cuda.current_stream()``, and one persistent
workspace per device that only grows.

Layouts: activations and weights are passed to cuDNN channels_last (NHWC); inputs that are NCHW are
converted by the kernel, outputs are channels_last. When a convolution's input channel count is not
a multiple of 8 (fp16/bf16) or 4 (fp32) the image and weight are zero-padded in channels.

Precision: fp16 and bf16 I/O with fp32 intermediate and compute types; fp32 I/O follows
``torch.backends.cudnn.allow_tf32`` (TF32 allowed by default, as PyTorch's own cuDNN convolutions).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError, condense
from ..region import Region
from ..runtime.plan_cache import PlanCache, StaleEntry, default_cache_dir
from ..backward import RegionBackward
from ..runtime.region_op import register_backward, register_kernel, run_region
from .base import Kernel, Support
from .autotune import (PYTORCH_MARGIN, PlanTiming, autotune, fastest, gpu_time_ms, sample_inputs,
                       sample_pack)
from .cudnn_backward import CudnnConvGradients
from .cudnn_graph import (CudnnGraph, build_graph, channel_padding, import_cudnn, nhwc_strides,
                          output_dtype, to_nhwc)

__all__ = ["CudnnBackend", "CudnnKernel", "CudnnPlan"]

_OUTPUT_UID = 1000
_CONSTANT_UID = 2000
DEFAULT_AUTOTUNE = 8


def _condense(exc: BaseException) -> str:
    return condense(str(exc).strip() or type(exc).__name__, limit=400)


class CudnnBackend:
    """Lower regions to cuDNN execution plans (see module docstring).

    Args:
        cache_dir: directory of the plan cache; ``None`` for the default, ``False`` to disable.
        autotune: how many of the ranked plans to build and time per region (the fastest is
            kept, see :mod:`.autotune`); ``0`` or ``1`` takes heuristics' first plan that builds.
    """

    name = "cudnn"
    _instances: dict[Any, "CudnnBackend"] = {}
    _lock = threading.Lock()

    def __init__(self, cache_dir=None, autotune: int = DEFAULT_AUTOTUNE):
        self.cache = PlanCache(default_cache_dir(cache_dir))
        self.autotune = int(autotune)
        self._handles: dict[int, Any] = {}
        self._workspaces: dict[int, torch.Tensor] = {}

    @classmethod
    def shared(cls, cache_dir=None, autotune: int = DEFAULT_AUTOTUNE) -> "CudnnBackend":
        """One backend (handles, workspaces) per (cache directory, autotune), shared by all
        compiled modules."""
        key = (str(default_cache_dir(cache_dir)), int(autotune))
        with cls._lock:
            if key not in cls._instances:
                cls._instances[key] = cls(cache_dir, autotune)
            return cls._instances[key]

    # ------------------------------------------------------------------ devices
    def handle(self, device: torch.device) -> Any:
        """The cuDNN handle of ``device``, its stream set to the current torch stream."""
        cudnn = import_cudnn()
        index = device.index if device.index is not None else torch.cuda.current_device()
        h = self._handles.get(index)
        if h is None:
            with torch.cuda.device(index):
                h = self._handles[index] = cudnn.create_handle()
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(index).cuda_stream)
        return h

    def workspace(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A workspace of at least ``nbytes`` bytes on ``device`` (uint8), kept and reused."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        ws = self._workspaces.get(index)
        if ws is None or ws.numel() < nbytes:
            ws = self._workspaces[index] = torch.empty(max(nbytes, 1), dtype=torch.uint8,
                                                       device=torch.device("cuda", index))
        return ws

    @staticmethod
    def device_fields(device: torch.device) -> dict:
        """GPU name, SM and versions: what a serialized plan is valid for."""
        cudnn = import_cudnn()
        major, minor = torch.cuda.get_device_capability(device)
        return {"gpu": torch.cuda.get_device_name(device), "sm": f"{major}{minor}",
                "cudnn": int(cudnn.backend_version()), "frontend": cudnn.__version__}

    # ------------------------------------------------------------------ protocol
    def supports(self, region: Region) -> Support:
        try:
            import_cudnn()
        except UnsupportedError as exc:
            return Support(False, exc.reason)
        if not torch.cuda.is_available():
            return Support(False, "CUDA is not available on this machine")
        for ph in region.graph_module.graph.find_nodes(op="placeholder"):
            device = ph.meta["val"].device
            if device.type != "cuda":
                return Support(False, f"input {ph.name} is on {device}; cuDNN runs CUDA tensors")
        dtype = region.conv.args[0].meta["val"].dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return Support(False, f"dtype {dtype} is not fused (fp16, bf16 and fp32 are)")
        k = region.conv.meta["val"].shape[1]
        multiple = 4 if dtype == torch.float32 else 8
        if k % multiple:
            return Support(False, f"{k} output channels is not a multiple of {multiple}, which "
                                  f"cuDNN's NHWC {dtype} engines need")
        return Support(True)

    def lower(self, region: Region, training: bool = False) -> Kernel:
        """Build (or load from the plan cache) the region's execution plan.

        With ``training`` the kernel is differentiable: its backward
        (:class:`~fusion_compiler.backward.RegionBackward`) runs the convolution's dgrad and wgrad
        as cuDNN graphs (:mod:`.cudnn_backward`); ``region.gradients`` lists how each runs.
        ``region`` must then come from :func:`~fusion_compiler.backward.training_region`, and
        ``region.no_grad_inputs`` names inputs that never need a gradient.

        When autotuning (``autotune > 1``) the kernel is also timed against the region's own
        PyTorch ops on random inputs of its shapes, and declined when PyTorch is at least 10%
        faster. The timing is stored beside the plan in the cache, so a later compile that loads
        the plan makes the same choice without timing again.

        Raises:
            UnsupportedError: cuDNN rejected the forward graph (the reason is cuDNN's own
                message), or PyTorch's ops were faster (the reason gives both times).
        """
        kernel = CudnnKernel(self, region)
        if self.autotune > 1:
            slower = _slower_than_pytorch(region, kernel)
            if slower:
                raise UnsupportedError(slower, region.region_id)
        if training:
            skip = frozenset({"dgrad"} if _conv_image(region) in region.no_grad_inputs else ())
            grads = CudnnConvGradients(self, region, skip, weight_cache=kernel.weight_cache)
            register_backward(kernel.key, RegionBackward(region, grads))
            region.gradients = grads.pieces
        return kernel.call


def _slower_than_pytorch(region: Region, kernel: "CudnnKernel") -> str:
    """Time ``kernel`` (input preparation included) against the region's PyTorch ops; a reason
    when PyTorch is at least 10% faster, else ``""``. Sets ``region.timing``.

    Measured cases on an H100: a 7x7 stride-2 conv on 3 channels zero-padded to 8 (the resnet
    stem) ran far slower on cuDNN's runtime-fusion engines than PyTorch's conv + pointwise ops.
    """
    inputs = sample_inputs(region)

    def measure() -> tuple[float, float]:
        return (gpu_time_ms(lambda: kernel.call(*inputs)),
                gpu_time_ms(lambda: region.graph_module(*inputs)))

    fused_ms, torch_ms = kernel.plan.timed_against_pytorch(measure)
    region.timing = {"cudnn_ms": fused_ms, "pytorch_ms": torch_ms}
    if torch_ms < PYTORCH_MARGIN * fused_ms:
        return (f"PyTorch ops were faster on this GPU: {torch_ms:.4f} ms against "
                f"{fused_ms:.4f} ms on cuDNN (best timed plan, input preparation included)")
    return ""


def _conv_image(region: Region) -> str:
    """The placeholder the region's convolution input comes from (through its prologue)."""
    node = region.conv.args[0]
    while node.op != "placeholder":
        node = node.args[0]
    return node.name


class CudnnPlan:
    """One cuDNN graph made executable: uids assigned, its plan loaded from the on-disk cache or
    built (heuristics A then FALLBACK, autotuned when ``backend.autotune > 1``) and cached.

    Args:
        backend: the :class:`CudnnBackend` (handles, workspaces, cache, autotune setting).
        device: the CUDA device the plan runs on.
        spec: the graph and its input/output/constant tensors (:class:`CudnnGraph`).
        label: names the graph in warnings and errors (``"r3"``, ``"r3 dgrad"``).

    Raises:
        UnsupportedError: cuDNN rejected the graph; the reason is cuDNN's own message.
    """

    def __init__(self, backend: CudnnBackend, device: torch.device, spec: CudnnGraph, label: str):
        self.backend = backend
        self.device = device
        self.label = label
        for i, t in enumerate(spec.inputs):
            t.set_uid(i + 1)
        for j, t in enumerate(spec.outputs):
            t.set_uid(_OUTPUT_UID + j)
        for k, (t, _) in enumerate(spec.constants):
            t.set_uid(_CONSTANT_UID + k)
        self.constants = {_CONSTANT_UID + k: host for k, (_, host) in enumerate(spec.constants)}
        self.tuning: list[PlanTiming] = []
        self.graph = self._build(spec, str(spec.graph))
        self.workspace_bytes = int(self.graph.get_workspace_size())
        backend.workspace(device, self.workspace_bytes)  # grow now, not during capture

    def _build(self, spec: CudnnGraph, graph_text: str) -> Any:
        cudnn = import_cudnn()
        graph = spec.graph
        cache = self.backend.cache
        header = self.header = PlanCache.header(
            graph_text, {**CudnnBackend.device_fields(self.device),
                         "autotune": self.backend.autotune})
        self.from_cache = False
        try:
            blob = cache.load(header)
        except StaleEntry as exc:
            warnings.warn(f"{exc}; rebuilding the plan", stacklevel=5)
            blob = None
        if blob is not None:
            try:
                handle = self.backend.handle(self.device)
                loaded = cudnn.pygraph(handle=handle)
                loaded.deserialize(handle, blob)
                self.from_cache = True
                return loaded
            except Exception as exc:  # a bad blob must never crash compilation
                warnings.warn(f"plan cache entry for {self.label} could not be loaded "
                              f"({_condense(exc)}); rebuilding the plan", stacklevel=5)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            if self.backend.autotune > 1:
                pack = sample_pack({t.get_uid(): t for t in (*spec.inputs, *spec.outputs)},
                                   self.device)
                pack.update(self.constants)
                self.tuning = autotune(graph, pack, lambda: self.backend.handle(self.device),
                                       lambda n: self.backend.workspace(self.device, n),
                                       self.backend.autotune)
            else:
                graph.build_plans()
        except Exception as exc:  # cudnnGraphNotSupportedError and backend errors
            raise UnsupportedError(f"cuDNN rejected the graph: {_condense(exc)}",
                                   self.label) from exc
        try:
            cache.store(header, bytes(graph.serialize(as_bytes=True)))
        except Exception as exc:  # some engines cannot serialize: run without caching
            warnings.warn(f"plan of {self.label} not cached: {_condense(exc)}", stacklevel=5)
        return graph

    @property
    def plan_name(self) -> str:
        """The selected plan's engine name (with its time when autotuning chose it)."""
        best = fastest(self.tuning)
        if best is not None:
            timed = sum(t.ms is not None for t in self.tuning)
            return f"{best.name} ({best.ms * 1000:.1f} us, best of {timed})"
        try:
            return str(self.graph.get_plan_name_at_index(0))
        except Exception:  # a deserialized graph may not expose plan names
            return ""

    def timed_against_pytorch(self, measure: Callable[[], tuple[float, float]],
                              record_name: str = "pytorch_timing") -> tuple[float, float]:
        """``(cudnn_ms, pytorch_ms)`` of this plan against the PyTorch ops it replaces.

        ``measure()`` runs only when the plan was built now or the cache holds no record named
        ``record_name`` for it (name a new method of measuring anew); its result is stored
        beside the plan in the cache, and a plan loaded from the cache reuses the stored timing,
        so warm compiles skip the timing and every process makes the same choice for the same
        plan.
        """
        cache = self.backend.cache
        record = cache.load_record(self.header, record_name) if self.from_cache else None
        if record is not None:
            return float(record["cudnn_ms"]), float(record["pytorch_ms"])
        cudnn_ms, pytorch_ms = measure()
        cache.store_record(self.header, record_name,
                           {"cudnn_ms": cudnn_ms, "pytorch_ms": pytorch_ms})
        return cudnn_ms, pytorch_ms

    def execute(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Run the plan: ``inputs``/``outputs`` in the graph's input/output order, laid out as
        declared (fully packed NHWC for 4-d tensors), on the current torch stream."""
        pack: dict[int, torch.Tensor] = {i + 1: x for i, x in enumerate(inputs)}
        pack.update({_OUTPUT_UID + j: y for j, y in enumerate(outputs)})
        pack.update(self.constants)
        ws = self.backend.workspace(self.device, self.workspace_bytes)
        self.graph.execute(pack, ws, handle=self.backend.handle(self.device))


class CudnnKernel:
    """One region's forward: its :class:`CudnnPlan` and how to feed it."""

    def __init__(self, backend: CudnnBackend, region: Region):
        self.backend = backend
        self.region_id = region.region_id
        placeholders = [n for n in region.graph_module.graph.nodes if n.op == "placeholder"]
        self.device = placeholders[0].meta["val"].device
        spec = build_graph(region, handle=backend.handle(self.device))
        self.plan = CudnnPlan(backend, self.device, spec, f"region {region.region_id}")

        pad = channel_padding(region)
        self.prepare: list[Callable[[torch.Tensor], torch.Tensor]] = []
        # the convolution weight's channels_last copy, shared with the dgrad (one copy per step)
        self.weight_cache: _WeightCache | None = None
        for node, op in zip(placeholders, region.operands()):
            if pad is not None and node.name in pad[1]:
                self.prepare.append(_padder(pad[0]))
            elif op.role in ("scalar", "channel"):
                shape4 = [1] * (4 - len(op.shape)) + list(op.shape)
                self.prepare.append(lambda t, s=shape4: t.reshape(s).contiguous())
            elif op.role == "weight":
                self.prepare.append(_WeightCache())
                if node is region.conv.args[1]:
                    self.weight_cache = self.prepare[-1]
            else:
                self.prepare.append(to_nhwc)
        self.outputs = []  # (shape, strides, dtype cuDNN writes, dtype the region returns)
        for out in region.output_nodes:
            val = out.meta["val"]
            self.outputs.append((tuple(val.shape), tuple(nhwc_strides(tuple(val.shape))),
                                 output_dtype(out), val.dtype))
        self.key = register_kernel(self, [(s, st, dt) for s, st, _, dt in self.outputs])
        region.plan = self.plan.plan_name
        region.plan_from_cache = self.plan.from_cache
        region.workspace_bytes = self.plan.workspace_bytes
        region.tuning = self.plan.tuning

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = tuple(torch.empty_strided(shape, stride, dtype=written, device=self.device)
                     for shape, stride, written, _ in self.outputs)
        self.plan.execute([prep(x) for prep, x in zip(self.prepare, inputs)], outs)
        return tuple(out if out.dtype == want else out.to(want)
                     for out, (_, _, _, want) in zip(outs, self.outputs))

    def call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run through the ``fusion_compiler::run_region`` custom op (what graphs call)."""
        return tuple(run_region(self.key, list(inputs)))


class _WeightCache:
    """channels_last copy of a weight, made once per weight version instead of once per call.

    Keyed by the tensor object itself (held weakly) and its version counter (``Tensor._version``
    grows on every in-place update, optimizer steps included), so an updated parameter is copied
    again, and a weight computed afresh each call (a rewritten weight in training, an inference
    tensor) is always converted: a new tensor may reuse a freed one's memory and version number,
    so storage address and version alone would return a stale copy.
    """

    def __init__(self):
        self.source: weakref.ref | None = None
        self.version = -1
        self.value: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous(memory_format=torch.channels_last):
            return t
        if t.is_inference():  # made under inference_mode: no version counter, a fresh tensor
            return t.contiguous(memory_format=torch.channels_last)
        if self.source is None or self.source() is not t or self.version != t._version:
            self.value = t.contiguous(memory_format=torch.channels_last)
            self.source, self.version = weakref.ref(t), t._version
        return self.value


def _padder(channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """NCHW-logical tensor -> channels_last tensor zero-padded to ``channels`` channels, in one copy."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        nhwc = t.permute(0, 2, 3, 1)
        return F.pad(nhwc, (0, channels - t.shape[1])).permute(0, 3, 1, 2)
    return pad

