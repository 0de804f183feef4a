"""The cuDNN backend: each region runs as one cuDNN execution plan.

Per region (and so per shapes, strides, dtypes and device, since regions are specialized) it
describes the graph as a recipe (:mod:`.graph`), loads the plan from the on-disk
:class:`~fusion_compiler.runtime.plan_cache.PlanCache` or builds candidate plans (heuristics A then
FALLBACK) and keeps the fastest (:class:`~.plan.CudnnPlan`). Building is slow CPU work
(:mod:`.workers`; measurements: docs/decisions.md, "Plan building in worker processes"), so
:meth:`CudnnBackend.prefetch` hands the plans of all regions of a graph to worker processes at once
before they are lowered one by one. Regions with the same graph on the same shapes share one plan
(one build, one autotune).
A region whose graph was tuned at another batch size (within a factor of 2) reuses that choice of
engine and knobs and that decision against PyTorch's ops: one build, no timing.

At run time a plan executes with the calling thread's cuDNN handle of its device, whose stream
follows ``torch.cuda.current_stream()`` (set only when it changed), and a persistent workspace per
device and stream that only grows (:mod:`.resources`). Inference kernels are called directly
(``CudnnKernel.__call__``), without the ``fusion_compiler::run_region`` custom op; traced or
differentiated calls go through the op.

Layouts: activations and weights are passed to cuDNN channels_last (NHWC); inputs that are NCHW are
converted by the kernel, outputs are channels_last. When a convolution's input channel count is not
a multiple of 8 (fp16/bf16) or 4 (fp32) the image and weight are zero-padded in channels; when its
output channel count is not, inference kernels pad the weight's output channels and the epilogue's
per-channel and full operands, and copy the real channels out of the padded outputs
(:func:`.graph.output_padding`).

Precision: fp16 and bf16 I/O with fp32 intermediate and compute types; fp32 I/O follows
``torch.backends.cudnn.allow_tf32`` (TF32 allowed by default, as PyTorch's own cuDNN convolutions).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Sequence

import torch

from ...config import CompileOptions
from ...ir.errors import UnsupportedError
from ...ir.ops import node_device
from ...ir.region import BackwardPlan, Region
from ...runtime.background import on_background_thread, warn_once
from ...runtime.plan_cache import PlanCache, default_cache_dir
from ...runtime.tensors import before_captures_on_a_thread, capture_owner
from ..base import REUSE_BATCH_RATIO, Backend, Lowered, Support
from ..glue_stand_in import pytorch_timing_record
from .backward import register_cudnn_backward
from .graph import graph_json, import_cudnn, output_padding, region_recipe
from .kernel import CudnnKernel
from .plan import condense_error
from .recipe import any_batch_key, recipe_key
from .resources import HandlePool, Workspaces
from .support import cudnn_support, known_slow_on_cudnn, slower_than_pytorch
from .workers import PlanWorkers, build_candidates, workers_for

__all__ = ["CudnnBackend", "HEURISTICS", "REUSE_BATCH_RATIO"]

HEURISTICS = ("A", "FALLBACK")
"""cuDNN heuristics modes whose ranked plans are candidates, in this order."""


def _create_handle(index: int) -> Any:
    with torch.cuda.device(index):
        handle = import_cudnn().create_handle()
    global _HELD_BEFORE_CAPTURES
    if not _HELD_BEFORE_CAPTURES:  # the frontend works: threads hold a handle before capturing
        _HELD_BEFORE_CAPTURES = True
        before_captures_on_a_thread(_hold_handle)
    return handle


def _set_stream(handle: Any, stream: int) -> None:
    import_cudnn().set_stream(handle=handle, stream=stream)


_HANDLES = HandlePool(_create_handle, _set_stream)
"""The calling thread's cuDNN handles, shared by every :class:`CudnnBackend`."""
_HELD_BEFORE_CAPTURES = False


def _hold_handle(index: int) -> None:
    """Make the calling thread's handle of device ``index`` before it captures a CUDA graph: a
    handle made inside a capture fails (:func:`~fusion_compiler.runtime.tensors.
    ready_to_capture`)."""
    _HANDLES.get(index, torch._C._cuda_getCurrentRawStream(index))


class CudnnBackend(Backend):
    """Lower regions to cuDNN execution plans (see module docstring).

    Args:
        cache_dir: directory of the plan cache; ``None`` for the default, ``False`` to disable.
        autotune: how many of the ranked plans to build and time per region (the fastest is
            kept, see :mod:`.autotune`); ``0`` or ``1`` takes heuristics' first plan that builds.
    """

    name = "cudnn"
    _instances: dict[Any, "CudnnBackend"] = {}
    _lock = threading.Lock()

    def __init__(self, cache_dir=None, autotune: int = CompileOptions.autotune):
        self.cache = PlanCache(default_cache_dir(cache_dir))
        self.autotune = int(autotune)
        self._workspaces = Workspaces()
        # recipe key -> (job, its build)
        self._pending: dict[str, list[tuple[dict, concurrent.futures.Future]]] = {}
        self.choices: dict[str, dict] = {}  # any-batch key -> {"engine", "name", records}

    @classmethod
    def shared(cls, cache_dir=None, autotune: int = CompileOptions.autotune) -> "CudnnBackend":
        """One backend (plans, workspaces) per (cache directory, autotune), shared by all
        compiled modules."""
        key = (str(default_cache_dir(cache_dir)), int(autotune))
        with cls._lock:
            if key not in cls._instances:
                cls._instances[key] = cls(cache_dir, autotune)
            return cls._instances[key]

    @classmethod
    def for_options(cls, options: CompileOptions) -> "CudnnBackend":
        """The shared backend of ``options.cache_dir`` and ``options.autotune``."""
        return cls.shared(options.cache_dir, options.autotune)

    # ------------------------------------------------------------------ devices
    def handle(self, device: torch.device) -> Any:
        """The calling thread's cuDNN handle of ``device``, its stream set to the current torch
        stream (the frontend skips ``cudnnSetStream`` when the stream did not change); one per
        thread (:class:`.resources.HandlePool`)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _HANDLES.get(index, torch._C._cuda_getCurrentRawStream(index))

    def workspace(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A workspace of at least ``nbytes`` bytes (uint8) on ``device`` for the plans run on the
        current stream, kept and reused; one that a CUDA graph captured is never freed, and a
        runner's graphs get their own (:class:`.resources.Workspaces`)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch._C._cuda_getCurrentRawStream(index) if device.type == "cuda" else 0
        return self._workspaces.get(torch.device(device.type, index), stream, nbytes,
                                    torch.cuda.is_current_stream_capturing(), capture_owner())

    @staticmethod
    def device_fields(device: torch.device) -> dict:
        """GPU name, SM and versions: what a serialized plan is valid for."""
        cudnn = import_cudnn()
        major, minor = torch.cuda.get_device_capability(device)
        return {"gpu": torch.cuda.get_device_name(device), "sm": f"{major}{minor}",
                "cudnn": int(cudnn.backend_version()), "frontend": cudnn.__version__}

    def header(self, key: str, device: torch.device) -> dict:
        """The plan cache header of the graph whose :func:`.recipe.recipe_key` is ``key``."""
        return PlanCache.header(key, {**self.device_fields(device), "autotune": self.autotune,
                                      "heuristics": list(HEURISTICS)})

    # ------------------------------------------------------------------ plan building
    def _job(self, recipe: dict, choice: dict | None) -> list[dict]:
        """The worker jobs (:func:`.workers.build_candidates`) that build ``recipe``'s
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
        """Start building the plans of ``regions`` in worker processes (:mod:`.workers`),
        so that :meth:`lower` finds them built. Regions whose plan is cached, that this backend
        declines, or that share a graph with one already started add no job. Does nothing with
        fewer than two jobs or without workers (``FUSION_COMPILER_BUILD_WORKERS=0``)."""
        jobs: dict[str, list[dict]] = {}
        device = None
        for region in regions:
            recipe = self._recipe(region)
            needed = None if recipe is None else self._uncached_jobs(region, recipe)
            if needed is None or needed[0] in self._pending or needed[0] in jobs:
                continue
            key, device, jobs[key] = needed
        if sum(map(len, jobs.values())) < 2:
            return
        pool = self._pool(device)
        if pool is not None:
            for key, group in jobs.items():
                self._pending[key] = [(job, pool.submit(job)) for job in group]

    @staticmethod
    def _pool(device: torch.device) -> PlanWorkers | None:
        """The plan-build worker processes of ``device``'s GPU, or ``None`` (too few CPUs, or
        none could start: plans then build in this process)."""
        try:
            return workers_for(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
        except (OSError, RuntimeError) as exc:
            warn_once("starting the plan-build worker processes",
                      f"{condense_error(exc)}; plans build in this process")
            return None

    def plan_work(self, region: Region) -> str:
        """What :meth:`lower` has to do for ``region``'s plan beyond loading it: ``""`` (its plan
        is in the cache, or this backend does not take the region), ``"build"`` (one build, of
        the choice made at another batch size within ``REUSE_BATCH_RATIO``, or of heuristics'
        first plan with ``autotune <= 1``: nothing timed) or ``"tune"`` (candidate plans built
        and timed on the GPU, and the plan timed against PyTorch's ops; also a plan in the cache,
        or a choice to follow, without a timing against PyTorch's ops as they are timed now).
        Raises nothing."""
        recipe = self._recipe(region)
        if recipe is None:
            return ""
        needed = self._uncached_jobs(region, recipe)
        if needed is not None and needed[2][0]["mode"] == "ranked":
            return "tune"
        if self._untimed_against_pytorch(region, recipe, cached=needed is None):
            return "tune"
        return "" if needed is None else "build"

    def _untimed_against_pytorch(self, region: Region, recipe: dict, cached: bool) -> bool:
        """Whether lowering ``region`` times its plan against the region's PyTorch ops
        (``autotune > 1``) and finds no timing stored under the name of how they are timed now
        (:func:`~fusion_compiler.backends.glue_stand_in.pytorch_timing_record`; a cache written
        before that way of timing, or for the other kind of glue): beside the ``cached`` plan,
        or in the choice made at another batch size that a plan to build follows."""
        if self.autotune <= 1:
            return False
        device, name = node_device(region.conv), pytorch_timing_record()
        if cached:
            return self.cache.load_record(self.header(recipe_key(recipe), device), name) is None
        return name not in (self.choice_for(recipe, device) or {})

    def _recipe(self, region: Region) -> dict | None:
        """``region``'s cuDNN recipe, or ``None`` where this backend declines the region or the
        recipe cannot be written."""
        if not self.supports(region):
            return None
        try:
            return region_recipe(region)
        except UnsupportedError:
            return None

    def _uncached_jobs(self, region: Region, recipe: dict
                       ) -> tuple[str, torch.device, list[dict]] | None:
        """``(recipe key, device, worker jobs)`` of the plan of ``region`` (its cuDNN ``recipe``)
        when it must be built (the jobs as :meth:`_job` makes them); ``None`` when its plan is in
        the cache."""
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
        """The built candidate plans of ``recipe`` (see :func:`.workers.build_candidates`)
        and whether they follow a choice made at another batch size (only with ``reuse``); from
        the jobs :meth:`prefetch` started, else, on the background thread, from worker processes
        (the frontend holds the GIL while it builds, which would stall the caller's thread:
        docs/decisions.md, "Plans build in worker processes while the caller's work runs"), else
        built now in this process (one WARNING names why, where workers should have built them).

        Raises:
            UnsupportedError: cuDNN rejected the graph (its reason).
        """
        pending = self._pending.pop(key, None) if reuse else None
        if pending is None:
            jobs = self._job(recipe, self.choice_for(recipe, device) if reuse else None)
            pool = self._pool(device) if on_background_thread() else None
            if pool is not None:
                pending = [(job, pool.submit(job)) for job in jobs]
            else:
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
                    warn_once("building a plan in a worker process",
                              f"{condense_error(exc)}; such plans build in this process")
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
        return cudnn_support(region)

    def lower(self, region: Region, training: bool = False,
              backward: BackwardPlan | None = None) -> Lowered:
        """Build (or load from the plan cache) the region's execution plan.

        With ``training`` the kernel is differentiable: its backward
        (:class:`~fusion_compiler.autograd.backward.RegionBackward`) runs the convolution's dgrad
        and wgrad as cuDNN graphs (:mod:`.backward`, as ``backward`` plans them: no dgrad for an
        input in ``backward.no_grad_inputs``, the ReLU backward fused with ``dgrad_drelu``); the
        result's ``gradients`` lists how each piece runs. ``region`` must then come from
        :func:`~fusion_compiler.autograd.backward.training_region`. Without it the kernel is
        called directly, outside the ``run_region`` custom op, unless traced.

        When autotuning (``autotune > 1``) the kernel is also timed against the region's own
        PyTorch ops on random inputs of its shapes, and declined when PyTorch is at least 10%
        faster. The timing is stored beside the plan in the cache, so a later compile that loads
        the plan makes the same choice without timing again.

        Raises:
            UnsupportedError: cuDNN rejected the forward graph (the reason is cuDNN's own
                message), or PyTorch's ops were faster (the reason gives both times; the error's
                ``timing`` has them, its ``nhwc_inputs`` the channels_last inputs PyTorch's ops
                were timed on, which the graph should hand them).
        """
        if training and output_padding(region) is not None:
            k = region.conv.meta["val"].shape[1]
            raise UnsupportedError(f"{k} output channels are padded for cuDNN in inference only; "
                                   f"in training this region runs on PyTorch", region.region_id)
        if self.autotune <= 1 and (slow := known_slow_on_cudnn(region)):
            raise UnsupportedError(slow, region.region_id)
        kernel = CudnnKernel(self, region, direct=not training)
        timing: dict[str, float] = {}
        if self.autotune > 1:
            slower, timing = slower_than_pytorch(region, kernel)
            if slower:
                # PyTorch's ops run it now, as they were timed: on channels_last activations
                # (sample_inputs), which the graph then hands them, and on the image with its own
                # channels (the kernel's padding is not theirs)
                nhwc = frozenset(i for i, op in enumerate(region.operands())
                                 if op.role in ("image", "full") and len(op.shape) == 4)
                raise UnsupportedError(slower, region.region_id, timing=timing,
                                       nhwc_inputs=nhwc)
        gradients: tuple = ()
        if training:
            gradients = register_cudnn_backward(self, region, kernel.key, backward,
                                                kernel.weight_cache)
        plan = kernel.plan
        return Lowered(kernel.call, plan=plan.plan_name, plan_from_cache=plan.from_cache,
                       workspace_bytes=plan.workspace_bytes, tuning=tuple(plan.tuning),
                       timing=timing, gradients=gradients, nhwc_inputs=kernel.nhwc_inputs,
                       padded_images=kernel.padded_images)

    def graph_json(self, region: Region) -> dict | None:
        """The cuDNN graph of ``region`` as the frontend prints it (built without a GPU too), or
        ``None`` when the frontend does not import or has no mapping for an op."""
        try:
            return graph_json(region)
        except UnsupportedError:
            return None


def _batch(recipe: dict) -> int:
    """The batch size of a recipe (its first batched tensor's first dimension; 0 if none)."""
    return next((t["dim"][0] for t in recipe["inputs"] if t.get("batched")), 0)
