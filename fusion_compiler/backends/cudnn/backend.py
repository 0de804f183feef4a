"""The cuDNN backend: each region runs as one cuDNN execution plan.

Per region (and so per shapes, strides, dtypes and device, since regions are specialized) it
describes the graph as a recipe (:mod:`.cudnn_graph`), loads the plan from the on-disk
:class:`~fusion_compiler.runtime.plan_cache.PlanCache` or builds candidate plans (heuristics A then
FALLBACK) and keeps the fastest (:class:`~.cudnn_plan.CudnnPlan`). Building is CPU work
(0.03-0.5 s a plan in the compiling process on an H100 machine, see :mod:`.plan_workers`), so
:meth:`CudnnBackend.prefetch` hands the plans of all regions of a graph to worker processes at once
before they are lowered one by one. Regions with the same graph on the same shapes share one plan
(one build, one autotune).
A region whose graph was tuned at another batch size (within a factor of 2) reuses that choice of
engine and knobs and that decision against PyTorch's ops: one build, no timing.

At run time a plan executes with one cuDNN handle per device whose stream follows
``torch.cuda.current_stream()`` (set only when it changed), and one persistent workspace per device
that only grows. Inference kernels are called directly (``CudnnKernel.__call__``), without the
``fusion_compiler::run_region`` custom op; traced or differentiated calls go through the op.

Layouts: activations and weights are passed to cuDNN channels_last (NHWC); inputs that are NCHW are
converted by the kernel, outputs are channels_last. When a convolution's input channel count is not
a multiple of 8 (fp16/bf16) or 4 (fp32) the image and weight are zero-padded in channels; when its
output channel count is not, inference kernels pad the weight's output channels and the epilogue's
per-channel and full operands, and copy the real channels out of the padded outputs
(:func:`.cudnn_graph.output_padding`).

Precision: fp16 and bf16 I/O with fp32 intermediate and compute types; fp32 I/O follows
``torch.backends.cudnn.allow_tf32`` (TF32 allowed by default, as PyTorch's own cuDNN convolutions).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ...ir.ops import node_device
from ...ir.errors import UnsupportedError
from ...ir.region import Region
from ...runtime.plan_cache import PlanCache, default_cache_dir
from ...autograd.backward import RegionBackward
from ...runtime.region_op import is_traced, register_backward, register_kernel, run_region
from ...runtime.streams import MAIN_WORKSPACE, SIDE_WORKSPACE, side_stream
from ..base import Kernel, Support
from ..timing import PYTORCH_MARGIN, paired_time_ms, sample_inputs
from .backward import CudnnConvGradients
from .graph import (channel_padding, import_cudnn, output_dtype, output_padding,
                          padded_output, region_recipe, to_nhwc)
from .plan import CudnnPlan, WeightCache, condense_error
from .recipe import any_batch_key, nhwc_strides, recipe_key
from .workers import build_candidates, workers_for

__all__ = ["CudnnBackend", "CudnnKernel", "CudnnPlan", "HEURISTICS", "DEFAULT_AUTOTUNE",
           "known_slow_on_cudnn"]

log = logging.getLogger("fusion_compiler")
DEFAULT_AUTOTUNE = 8
HEURISTICS = ("A", "FALLBACK")
"""cuDNN heuristics modes whose ranked plans are candidates, in this order."""
REUSE_BATCH_RATIO = 2.0
"""A plan choice made at batch size N is reused for batch sizes N/2 to 2N; outside, the graph is
tuned afresh (an engine that wins at one size may lose at a very different one)."""


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
        self._workspaces: dict[tuple[int, str], torch.Tensor] = {}
        # recipe key -> (job, its build)
        self._pending: dict[str, list[tuple[dict, concurrent.futures.Future]]] = {}
        self.choices: dict[str, dict] = {}  # any-batch key -> {"engine", "name", records}

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
        """The cuDNN handle of ``device``, its stream set to the current torch stream (the
        frontend skips ``cudnnSetStream`` when the stream did not change)."""
        cudnn = import_cudnn()
        index = device.index if device.index is not None else torch.cuda.current_device()
        h = self._handles.get(index)
        if h is None:
            with torch.cuda.device(index):
                h = self._handles[index] = cudnn.create_handle()
        cudnn.set_stream(handle=h, stream=torch._C._cuda_getCurrentRawStream(index))
        return h

    def workspace(self, device: torch.device, nbytes: int,
                  key: str = MAIN_WORKSPACE) -> torch.Tensor:
        """A workspace of at least ``nbytes`` bytes on ``device`` (uint8), kept and reused; one
        per ``key`` (regions on the side stream, ``SIDE_WORKSPACE``, may run beside the others)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        ws = self._workspaces.get((index, key))
        if ws is None or ws.numel() < nbytes:
            ws = self._workspaces[(index, key)] = torch.empty(
                max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", index))
        return ws

    @staticmethod
    def device_fields(device: torch.device) -> dict:
        """GPU name, SM and versions: what a serialized plan is valid for."""
        cudnn = import_cudnn()
        major, minor = torch.cuda.get_device_capability(device)
        return {"gpu": torch.cuda.get_device_name(device), "sm": f"{major}{minor}",
                "cudnn": int(cudnn.backend_version()), "frontend": cudnn.__version__}

    def header(self, key: str, device: torch.device) -> dict:
        """The plan cache header of the graph whose :func:`.cudnn_recipe.recipe_key` is ``key``."""
        return PlanCache.header(key, {**self.device_fields(device), "autotune": self.autotune,
                                      "heuristics": list(HEURISTICS)})

    # ------------------------------------------------------------------ plan building
    def _job(self, recipe: dict, choice: dict | None) -> list[dict]:
        """The worker jobs (:func:`.plan_workers.build_candidates`) that build ``recipe``'s
        candidate plans: the engine ``choice`` made at another batch size; else one job per ranked
        plan to time (``autotune > 1``); else the first plan that builds."""
        base = {"recipe": recipe, "heuristics": list(HEURISTICS)}
        if choice is not None:
            return [{**base, "mode": "engine", "engine": choice["engine"]}]
        if self.autotune > 1:
            return [{**base, "mode": "ranked", "indices": [i]} for i in range(self.autotune)]
        return [{**base, "mode": "first"}]

    def choice_for(self, recipe: dict, device: torch.device) -> dict | None:
        """The plan choice made for ``recipe``'s graph at another batch size within a factor of
        ``REUSE_BATCH_RATIO`` of its own (this process, or the cache's record), or ``None``."""
        key = any_batch_key(recipe)
        if key not in self.choices:
            record = self.cache.load_record(self.header(key, device), "choice")
            if record is None:
                return None
            self.choices[key] = record
        choice = self.choices[key]
        ratio = _batch(recipe) / max(1, choice.get("batch", 0))
        return choice if 1 / REUSE_BATCH_RATIO <= ratio <= REUSE_BATCH_RATIO else None

    def remember_choice(self, recipe: dict, device: torch.device, choice: dict) -> None:
        """Record the plan chosen for ``recipe`` (engine, knobs, timings) for other batch sizes."""
        key = any_batch_key(recipe)
        self.choices[key] = choice = {**choice, "batch": _batch(recipe)}
        self.cache.store_record(self.header(key, device), "choice", choice)

    def prefetch(self, regions: Sequence[Region]) -> None:
        """Start building the plans of ``regions`` in worker processes (:mod:`.plan_workers`),
        so that :meth:`lower` finds them built. Regions whose plan is cached, that this backend
        declines, or that share a graph with one already started add no job. Does nothing with
        fewer than two jobs or without workers (``FUSION_COMPILER_BUILD_WORKERS=0``)."""
        jobs: dict[str, list[dict]] = {}
        device = None
        for region in regions:
            needed = self._uncached_jobs(region)
            if needed is None or needed[0] in self._pending or needed[0] in jobs:
                continue
            key, device, jobs[key] = needed
        if sum(map(len, jobs.values())) < 2:
            return
        try:
            pool = workers_for(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
            if pool is None:
                return
            for key, group in jobs.items():
                self._pending[key] = [(job, pool.submit(job)) for job in group]
        except (OSError, RuntimeError) as exc:  # no worker could start: build in this process
            log.info("plan-build workers unavailable (%s); building plans in this process",
                     condense_error(exc))

    def plan_work(self, region: Region) -> str:
        """What :meth:`lower` has to do for ``region``'s plan beyond loading it: ``""`` (its plan
        is in the cache, or this backend does not take the region), ``"build"`` (one build, of
        the choice made at another batch size within ``REUSE_BATCH_RATIO``, or of heuristics'
        first plan with ``autotune <= 1``: nothing timed) or ``"tune"`` (candidate plans built
        and timed on the GPU, and the plan timed against PyTorch's ops). Raises nothing."""
        needed = self._uncached_jobs(region)
        if needed is None:
            return ""
        return "tune" if needed[2][0]["mode"] == "ranked" else "build"

    def _uncached_jobs(self, region: Region) -> tuple[str, torch.device, list[dict]] | None:
        """``(recipe key, device, worker jobs)`` of ``region``'s plan when it must be built (the
        jobs as :meth:`_job` makes them); ``None`` when this backend declines the region or its
        plan is in the cache."""
        if not self.supports(region):
            return None
        try:
            recipe = region_recipe(region)
        except UnsupportedError:
            return None
        device = node_device(region.conv)
        key = recipe_key(recipe)
        if self.cache.has(self.header(key, device)):
            return None
        return key, device, self._job(recipe, self.choice_for(recipe, device))

    def wait_for_prefetched(self, timeout: float | None = None) -> bool:
        """Block until every build :meth:`prefetch` started has ended (at most ``timeout`` s);
        returns whether they have. A failed build counts as ended (:meth:`candidates` reports
        it, or builds again in this process)."""
        futures = [f for group in list(self._pending.values()) for _, f in group
                   if f is not None]
        return not concurrent.futures.wait(futures, timeout=timeout).not_done

    def candidates(self, recipe: dict, key: str, device: torch.device,
                   reuse: bool = True) -> tuple[list[dict], bool]:
        """The built candidate plans of ``recipe`` (see :func:`.plan_workers.build_candidates`)
        and whether they follow a choice made at another batch size (only with ``reuse``); from
        the jobs :meth:`prefetch` started, else built now in this process.

        Raises:
            UnsupportedError: cuDNN rejected the graph (its reason).
        """
        pending = self._pending.pop(key, None) if reuse else None
        if pending is None:
            jobs = self._job(recipe, self.choice_for(recipe, device) if reuse else None)
            if len(jobs) > 1:  # in this process: one graph builds them all
                jobs = [{**jobs[0], "indices": [i for job in jobs for i in job["indices"]]}]
            pending = [(job, None) for job in jobs]
        reused = pending[0][0]["mode"] == "engine"
        results = []
        for job, future in pending:
            result = None
            if future is not None:
                try:
                    result = future.result()
                except Exception as exc:  # a worker died: build this one here
                    log.info("plan-build worker failed (%s); building in this process",
                             condense_error(exc))
            if result is None:
                with torch.cuda.device(device):
                    result = build_candidates(job)
            if "error" in result and reused:  # the engine rejects this shape's graph (seen:
                break  # "convert_to_backend_knob_type ... CUDNN_STATUS_INVALID_VALUE" at 2N)
            if "error" in result:
                raise UnsupportedError(f"cuDNN rejected the graph: {result['error']}")
            results.extend(result["plans"])
        if reused and not any(p["blob"] for p in results):  # the engine does not take this
            return self.candidates(recipe, key, device, reuse=False)  # shape: tune it
        return results, reused

    # ------------------------------------------------------------------ protocol
    def supports(self, region: Region) -> Support:
        try:
            import_cudnn()
        except UnsupportedError as exc:
            return Support(False, exc.reason)
        if not torch.cuda.is_available():
            return Support(False, "CUDA is not available on this machine")
        for ph in region.graph_module.graph.find_nodes(op="placeholder"):
            device = node_device(ph)
            if device.type != "cuda":
                return Support(False, f"input {ph.name} is on {device}; cuDNN runs CUDA tensors")
        dtype = region.conv.args[0].meta["val"].dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return Support(False, f"dtype {dtype} is not fused (fp16, bf16 and fp32 are)")
        k = region.conv.meta["val"].shape[1]
        multiple = 4 if dtype == torch.float32 else 8
        if k % multiple and output_padding(region) is None:
            return Support(False, f"{k} output channels is not a multiple of {multiple}, which "
                                  f"cuDNN's NHWC {dtype} engines need, and they cannot be padded "
                                  f"({_no_padding_reason(region)})")
        return Support(True)

    def lower(self, region: Region, training: bool = False) -> Kernel:
        """Build (or load from the plan cache) the region's execution plan.

        With ``training`` the kernel is differentiable: its backward
        (:class:`~fusion_compiler.backward.RegionBackward`) runs the convolution's dgrad and wgrad
        as cuDNN graphs (:mod:`.cudnn_backward`); ``region.gradients`` lists how each runs.
        ``region`` must then come from :func:`~fusion_compiler.backward.training_region`, and
        ``region.no_grad_inputs`` names inputs that never need a gradient. Without it the kernel
        is called directly, outside the ``run_region`` custom op, unless traced.

        When autotuning (``autotune > 1``) the kernel is also timed against the region's own
        PyTorch ops on random inputs of its shapes, and declined when PyTorch is at least 10%
        faster. The timing is stored beside the plan in the cache, so a later compile that loads
        the plan makes the same choice without timing again.

        Raises:
            UnsupportedError: cuDNN rejected the forward graph (the reason is cuDNN's own
                message), or PyTorch's ops were faster (the reason gives both times).
        """
        if training and output_padding(region) is not None:
            k = region.conv.meta["val"].shape[1]
            raise UnsupportedError(f"{k} output channels are padded for cuDNN in inference only; "
                                   f"in training this region runs on PyTorch", region.region_id)
        if self.autotune <= 1 and (slow := known_slow_on_cudnn(region)):
            raise UnsupportedError(slow, region.region_id)
        kernel = CudnnKernel(self, region, direct=not training)
        if self.autotune > 1:
            slower = _slower_than_pytorch(region, kernel)
            if slower:
                # PyTorch's ops run it now, as they were timed: on channels_last activations
                # (sample_inputs), which the graph then hands them
                # (runtime.layout.channels_last_activations), and on the image with its own
                # channels (the kernel's padding is not theirs)
                region.nhwc_inputs = frozenset(
                    i for i, op in enumerate(region.operands())
                    if op.role in ("image", "full") and len(op.shape) == 4)
                region.padded_images = {}
                raise UnsupportedError(slower, region.region_id)
        if training:
            skip = frozenset({"dgrad"} if _conv_image(region) in region.no_grad_inputs else ())
            grads = CudnnConvGradients(self, region, skip, weight_cache=kernel.weight_cache)
            register_backward(kernel.key, RegionBackward(region, grads))
            region.gradients = grads.pieces
        return kernel.call


def known_slow_on_cudnn(region: Region) -> str:
    """Why ``region`` stays on PyTorch ops when nothing is timed (``autotune <= 1``), or ``""``.

    A static rule for region kinds that cuDNN's runtime-fusion engines ran much slower than
    PyTorch on an H100 (cuDNN 9.19); with ``autotune > 1`` timing decides instead. One kind so
    far: depthwise convolutions of 7x7 taps or more (convnext_tiny with ``autotune=1`` ran 13.3 ms
    against eager's 4.8 ms; issue "Performance frontier"). resnet's 7x7 stem on zero-padded input
    channels was also slower in every timed plan (``_slower_than_pytorch``) but is left to cuDNN
    here: it is one region, and the GPU tests run it on cuDNN to check its gradients.
    """
    conv = region.conv
    x, w = conv.args[0].meta["val"], conv.args[1].meta["val"]
    kh, kw = w.shape[2], w.shape[3]
    if kh * kw < 49:
        return ""
    channels, groups = x.shape[1], conv.args[6]
    if groups > 1 and groups == channels:
        return (f"a depthwise {kh}x{kw} convolution: cuDNN's runtime-fusion engines ran these "
                f"slower than PyTorch (convnext_tiny, H100: 13.3 ms against eager's 4.8 ms); "
                f"with autotune > 1 timing decides")
    return ""


def _no_padding_reason(region: Region) -> str:
    """Why :func:`.cudnn_graph.output_padding` declines ``region`` (it returned ``None``)."""
    conv = region.conv
    if conv.args[6] != 1:
        return f"a grouped convolution ({conv.args[6]} groups)"
    if conv.args[1].op != "placeholder":
        return "the weight is computed in the region"
    return "an operand is read both before and after the convolution"


def _batch(recipe: dict) -> int:
    """The batch size of a recipe (its first batched tensor's first dimension; 0 if none)."""
    return next((t["dim"][0] for t in recipe["inputs"] if t.get("batched")), 0)


def _slower_than_pytorch(region: Region, kernel: "CudnnKernel") -> str:
    """Time ``kernel`` (input preparation included) against the region's PyTorch ops; a reason
    when PyTorch is at least 10% faster, else ``""``. Sets ``region.timing``.

    Measured cases on an H100: a 7x7 stride-2 conv on 3 channels zero-padded to 8 (the resnet
    stem) ran far slower on cuDNN's runtime-fusion engines than PyTorch's conv + pointwise ops.
    """
    inputs = sample_inputs(region)

    def measure() -> tuple[float, float]:
        # Paired (replays alternating), so drift during the measurement affects both alike:
        # timed one after the other, on a freshly started H100 the stem conv1x1 timed 0.0230 ms
        # on cuDNN against 0.0158 ms for PyTorch, and 0.0059 ms on cuDNN in other runs.
        fused, torch_ = paired_time_ms([lambda: kernel(*inputs),
                                        lambda: region.graph_module(*inputs)], reps=5)
        return fused, torch_

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


class CudnnKernel:
    """One region's forward: its :class:`CudnnPlan` and how to feed it.

    ``direct``: :meth:`call` runs the plan straight from Python (inference), unless its inputs
    are being traced; else through the ``fusion_compiler::run_region`` custom op (training,
    tracing), which costs about 20 us more per call on an H100 host.

    ``beside`` (set by :func:`~fusion_compiler.runtime.streams.run_short_branches_beside`, with
    :meth:`run_beside`): each call runs on the device's side stream, after the current stream's
    work issued so far, on a workspace of its own. Inputs past the region's own are ignored
    (that pass hands some kernels a side-stream region's outputs, to order the two).
    """

    def __init__(self, backend: CudnnBackend, region: Region, direct: bool = False):
        self.backend = backend
        self.region_id = region.region_id
        self.direct = direct
        placeholders = [n for n in region.graph_module.graph.nodes if n.op == "placeholder"]
        self.device = node_device(placeholders[0])
        self.plan = CudnnPlan(backend, self.device, region_recipe(region),
                              f"region {region.region_id}")

        pad = channel_padding(region)
        out_pad = output_padding(region)
        in_pads = pad[1] if pad is not None else set()
        out_pads = out_pad[1] if out_pad is not None else set()
        conv = region.conv
        self.prepare: list[Callable[[torch.Tensor], torch.Tensor]] = []
        # the convolution weight's channels_last copy, shared with the dgrad (one copy per step)
        self.weight_cache: WeightCache | None = None
        self.beside = False
        self.workspace = MAIN_WORKSPACE
        for node, op in zip(placeholders, region.operands()):
            if node is conv.args[1] and (node.name in in_pads or node.name in out_pads):
                # zero input and/or output channels, made once per weight version
                self.prepare.append(WeightCache(_weight_padder(
                    pad[0] if node.name in in_pads else None,
                    out_pad[0] if node.name in out_pads else None)))
            elif node.name in in_pads:
                self.prepare.append(_padder(pad[0]))
            elif node.name in out_pads:
                self.prepare.append(_operand_padder(out_pad[0], op.role))
            elif op.role in ("scalar", "channel"):
                # [1] / [K] / [1,K,1,1] contiguous: the same memory as the declared [1,K,1,1]
                self.prepare.append(torch.Tensor.contiguous)
            elif op.role == "weight":
                self.prepare.append(WeightCache())
                if node is region.conv.args[1]:
                    self.weight_cache = self.prepare[-1]
            else:
                self.prepare.append(to_nhwc)
        self.outputs = []  # (shape, strides, dtype cuDNN writes, dtype the region returns)
        self.padded: list[tuple[tuple[int, ...], int] | None] = []  # (shape written, channels)
        for out in region.output_nodes:
            val = out.meta["val"]
            shape = tuple(val.shape)
            self.outputs.append((shape, tuple(nhwc_strides(shape)), output_dtype(out),
                                 val.dtype))
            self.padded.append((shape[:1] + (out_pad[0],) + shape[2:], shape[1])
                               if out_pad is not None and padded_output(out, conv) else None)
        self._converts = any(written != want for _, _, written, want in self.outputs)
        self._pads_outputs = any(p is not None for p in self.padded)
        self.key = register_kernel(self, [(s, st, dt) for s, st, _, dt in self.outputs])
        region.plan = self.plan.plan_name
        region.plan_from_cache = self.plan.from_cache
        region.workspace_bytes = self.plan.workspace_bytes
        region.tuning = self.plan.tuning
        region.nhwc_inputs = frozenset(i for i, prep in enumerate(self.prepare) if prep is to_nhwc)
        region.padded_images = {i: pad[0] for i, node in enumerate(placeholders)
                                if node.name in in_pads and node is not conv.args[1]}

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.beside:  # forks: the side stream waits for what was issued so far
            side = side_stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                return self._call(inputs)
        return self._call(inputs)

    def _call(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        inputs = inputs[:len(self.prepare)]
        if self._pads_outputs:
            return self._padded_call(inputs)
        outs = tuple(torch.empty_strided(shape, stride, dtype=written, device=self.device)
                     for shape, stride, written, _ in self.outputs)
        self.plan.execute([prep(x) for prep, x in zip(self.prepare, inputs)], outs,
                          workspace=self.workspace)
        if not self._converts:
            return outs
        return tuple(out if out.dtype == want else out.to(want)
                     for out, (_, _, _, want) in zip(outs, self.outputs))

    def _padded_call(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Outputs with padded channels are written at their padded size, then their first
        channels copied out in the declared layout (one copy each)."""
        outs = []
        for (shape, stride, written, _), padded in zip(self.outputs, self.padded):
            size = shape if padded is None else padded[0]
            outs.append(torch.empty_strided(size, nhwc_strides(size), dtype=written,
                                            device=self.device))
        self.plan.execute([prep(x) for prep, x in zip(self.prepare, inputs)], outs,
                          workspace=self.workspace)
        result = []
        for out, (shape, stride, _, want), padded in zip(outs, self.outputs, self.padded):
            if padded is not None:
                out = torch.empty_strided(shape, stride, dtype=out.dtype,
                                          device=self.device).copy_(out[:, :padded[1]])
            result.append(out if out.dtype == want else out.to(want))
        return tuple(result)

    def run_beside(self) -> None:
        """Run on the side stream from now on (see the class doc); makes the stream and grows its
        workspace now, not in a CUDA graph capture."""
        self.beside, self.workspace = True, SIDE_WORKSPACE
        side_stream(self.device)
        self.backend.workspace(self.device, self.plan.workspace_bytes, SIDE_WORKSPACE)

    def call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What graphs call: the plan directly for inference, else the ``run_region`` op."""
        if self.direct and not is_traced(inputs[0]):
            return self(*inputs)
        return tuple(run_region(self.key, list(inputs)))


def _weight_padder(in_channels: int | None, out_channels: int | None
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[K,C,R,S]`` weight -> channels_last ``[K',C',R,S]`` with zero output channels up to
    ``out_channels`` and zero input channels up to ``in_channels`` (``None``: unchanged), in one
    copy."""
    def pad(w: torch.Tensor) -> torch.Tensor:
        k, c = out_channels or w.shape[0], in_channels or w.shape[1]
        krsc = F.pad(w.permute(0, 2, 3, 1), (0, c - w.shape[1], 0, 0, 0, 0, 0, k - w.shape[0]))
        return krsc.permute(0, 3, 1, 2)
    return pad


def _operand_padder(channels: int, role: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An epilogue operand with the conv's output channels -> ``channels`` channels (zeros
    after): a ``"channel"`` operand (``[K]``, ``[K,1,1]``, ``[1,K,1,1]``) as ``[1,K',1,1]``, a
    ``"full"`` one ``[N,K,P,Q]`` as channels_last ``[N,K',P,Q]``."""
    padder = _padder(channels)
    if role == "full":
        return padder
    return lambda t: padder(t.reshape(1, -1, 1, 1))


def _padder(channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """NCHW-logical tensor -> channels_last tensor zero-padded to ``channels`` channels, in one copy
    (none for a tensor that already is: the graph padded it, ``Region.padded_images``)."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == channels:  # no copy when it is channels_last already
            return t.contiguous(memory_format=torch.channels_last)
        nhwc = t.permute(0, 2, 3, 1)
        return F.pad(nhwc, (0, channels - t.shape[1])).permute(0, 3, 1, 2)
    return pad
