"""One cuDNN graph made executable (:class:`CudnnPlan`): the piece that both the forward kernels
(:mod:`.kernel`) and the dgrad/wgrad graphs (:mod:`.backward`) use, kept here so neither imports
the other.

A plan needs a backend object for handles, workspaces, the plan cache and candidate building: the
:class:`~.backend.CudnnBackend` (duck-typed here, see :class:`PlanBackend`).
"""

from __future__ import annotations

import atexit
import gc
import inspect
import warnings
import weakref
from typing import Any, Callable, Protocol, Sequence

import torch

from ...ir.errors import UnsupportedError, condense
from ...runtime.plan_cache import PlanCache, StaleEntry
from ...runtime.tensors import side_stream
from ..timing import ensure_timing_allowed, gpu_time_ms
from .autotune import PlanTiming, fastest, sample_pack
from .graph import import_cudnn
from .recipe import build_pygraph, recipe_key

__all__ = ["CudnnPlan", "PlanBackend", "condense_error"]


def condense_error(exc: BaseException) -> str:
    """An exception as one short line (its message, else its type name; 400 characters at most)."""
    return condense(str(exc).strip() or type(exc).__name__, limit=400)


class PlanBackend(Protocol):
    """What :class:`CudnnPlan` asks of its backend (:class:`~.backend.CudnnBackend` provides it)."""

    autotune: int
    cache: PlanCache

    def handle(self, device: torch.device) -> Any: ...

    def workspace(self, device: torch.device, nbytes: int) -> torch.Tensor: ...

    def header(self, key: str, device: torch.device) -> dict: ...

    def candidates(self, recipe: dict, key: str, device: torch.device) -> tuple[list[dict], bool]:
        ...

    def choice_for(self, recipe: dict, device: torch.device) -> dict | None: ...

    def remember_choice(self, recipe: dict, device: torch.device, choice: dict) -> None: ...


_LIVE: "weakref.WeakSet[CudnnPlan]" = weakref.WeakSet()
_RELEASE_REGISTERED = False


def _release_at_exit(plan: "CudnnPlan") -> None:
    """Track ``plan`` for :func:`release_all`, which the first plan registers to run at exit
    (after ``import cudnn``, so it runs before any exit handler the frontend registered)."""
    global _RELEASE_REGISTERED
    if not _RELEASE_REGISTERED:
        atexit.register(release_all)
        _RELEASE_REGISTERED = True
    _LIVE.add(plan)


def release_all() -> None:
    """Drop every plan's cuDNN frontend objects (its graph and the graph description's tensors)
    and collect them. Run at interpreter exit: objects of the frontend's C++ extension still alive
    when it is torn down are reported one by one on stderr ("nanobind: leaked ... instances"), and
    compiled modules a script keeps in globals outlive the exit handlers. Plans cannot run after
    it."""
    for plan in list(_LIVE):
        plan.graph = plan.spec = None
    gc.collect()


class CudnnPlan:
    """One cuDNN graph made executable: its plan loaded from the cache or built (candidates from
    heuristics A then FALLBACK, timed and the fastest kept when ``backend.autotune > 1``, or the
    choice made at another batch size) and cached.

    Args:
        backend: the :class:`~.backend.CudnnBackend` (handles, workspaces, cache, autotune
            setting).
        device: the CUDA device the plan runs on.
        recipe: the graph (:mod:`.recipe`); UIDs follow from it.
        label: names the graph in warnings and errors (``"r3"``, ``"r3 dgrad"``).

    Attributes:
        tuning: the candidates built now (``PlanTiming``, ranked order; empty when loaded).
        from_cache: the plan was loaded from the cache (disk, or built earlier in this process
            for an identical graph).
        reused_from: ``"choice made at another batch size"`` when the plan follows such a choice.

    Raises:
        UnsupportedError: cuDNN rejected the graph; the reason is cuDNN's own message.
    """

    def __init__(self, backend: PlanBackend, device: torch.device, recipe: dict, label: str):
        _release_at_exit(self)
        self.backend = backend
        self.device = device
        self.label = label
        self.recipe = recipe
        spec = self.spec = build_pygraph(recipe)  # the graph's tensors, for sample data and UIDs
        self.input_uids = [t.get_uid() for t in spec.inputs]
        self.output_uids = [t.get_uid() for t in spec.outputs]
        self.constants = {t.get_uid(): torch.full((1, 1, 1, 1), value, dtype=torch.float32)
                          for t, value in spec.constants}
        self.tuning: list[PlanTiming] = []
        self.reused_from = ""
        self.name = ""
        key = recipe_key(recipe)
        self.header = backend.header(key, device)
        self.graph = self._load() or self._build(key)
        self.workspace_bytes = int(self.graph.get_workspace_size())
        backend.workspace(device, self.workspace_bytes)  # this stream's, grown before any capture
        # execute()'s operands, in this order: inputs, outputs, constants
        self._uids = (*self.input_uids, *self.output_uids, *self.constants)
        self._constant_values = list(self.constants.values())
        self._ordered = "tensor_uids" in inspect.signature(self.graph.execute).parameters

    def _deserialize(self, blob: bytes) -> Any:
        # the handle on a side stream, never the legacy one: deserializing with a handle on the
        # legacy stream keeps a blocking stream capturing, and another thread's legacy-stream
        # work then fails (docs/decisions.md, "cuDNN deserialization captures")
        cudnn = import_cudnn()
        with torch.cuda.device(self.device), torch.cuda.stream(side_stream("cudnn-load")):
            handle = self.backend.handle(self.device)
            graph = cudnn.pygraph(handle=handle)
            graph.deserialize(handle, blob)
        return graph

    def _load(self) -> Any:
        """The cached plan as a graph, or ``None`` (a bad entry is reported and rebuilt)."""
        self.from_cache = False
        try:
            blob = self.backend.cache.load(self.header)
        except StaleEntry as exc:
            warnings.warn(f"{exc}; rebuilding the plan", stacklevel=6)
            return None
        if blob is None:
            return None
        try:
            graph = self._deserialize(blob)
        except Exception as exc:  # a bad blob must never crash compilation
            warnings.warn(f"plan cache entry for {self.label} could not be loaded "
                          f"({condense_error(exc)}); rebuilding the plan", stacklevel=6)
            return None
        self.from_cache = True
        choice = self.backend.cache.load_record(self.header, "choice") or {}
        self.name = choice.get("name", "")
        return graph

    def _build(self, key: str) -> Any:
        built, reused = self.backend.candidates(self.recipe, key, self.device)
        good = [p for p in built if p["blob"] is not None]
        if not good:
            reasons = "; ".join(f"{p['name']}: {p['error']}" for p in built) or "no plans"
            raise UnsupportedError(f"cuDNN rejected the graph: no plan could be built ({reasons})",
                                   self.label)
        if reused:
            self.reused_from = "choice made at another batch size"
        timed = self.backend.autotune > 1 and not reused and len(good) > 1
        graphs = {}
        for p in built:
            timing = PlanTiming(p["index"], p["name"], None, p["build_s"], p["workspace"],
                                p["error"])
            if p["blob"] is not None and (timed or not graphs):
                try:
                    graphs[p["index"]] = self._deserialize(p["blob"])
                except Exception as exc:
                    timing.reason = f"could not be loaded: {condense_error(exc)}"
            self.tuning.append(timing)
        if timed:
            ensure_timing_allowed(f"timing the candidate plans of {self.label}")  # not swallowed
            self._time(graphs)  # (a plan that fails to time is skipped, with its reason)
        best = fastest(self.tuning) if timed else next(
            (t for t in self.tuning if t.index in graphs), None)
        if best is None:
            reasons = "; ".join(f"{t.name}: {t.reason}" for t in self.tuning)
            raise UnsupportedError(f"cuDNN rejected the graph: no plan ran ({reasons})",
                                   self.label)
        chosen = next(p for p in built if p["index"] == best.index)
        self.name = best.name
        self.backend.cache.store(self.header, chosen["blob"])
        choice = {"engine": chosen["engine"], "name": best.name}
        self.backend.cache.store_record(self.header, "choice", choice)
        if not reused:
            self.backend.remember_choice(self.recipe, self.device, choice)
        return graphs[best.index]

    def _time(self, graphs: dict[int, Any]) -> None:
        """Time every loaded candidate on random data
        (:func:`~fusion_compiler.backends.timing.gpu_time_ms`)."""
        pack = sample_pack({t.get_uid(): t for t in (*self.spec.inputs, *self.spec.outputs)},
                           self.device)
        pack.update(self.constants)
        for timing in self.tuning:
            graph = graphs.get(timing.index)
            if graph is None:
                continue
            size = int(graph.get_workspace_size())
            try:  # the workspace of the stream each run is issued on (timing's own, in turn)
                timing.ms = gpu_time_ms(lambda: graph.execute(
                    pack, self.backend.workspace(self.device, size),
                    handle=self.backend.handle(self.device)))
            except Exception as exc:
                timing.reason = condense(str(exc) or type(exc).__name__, 200)

    @property
    def plan_name(self) -> str:
        """The selected plan's engine name (with its time when autotuning chose it, or where
        the choice came from)."""
        best = fastest(self.tuning)
        if best is not None:
            timed = sum(t.ms is not None for t in self.tuning)
            return f"{best.name} ({best.ms * 1000:.1f} us, best of {timed})"
        if self.reused_from:
            return f"{self.name} ({self.reused_from})"
        return self.name

    def timed_against_pytorch(self, measure: Callable[[], tuple[float, float]],
                              record_name: str = "pytorch_timing_paired") -> tuple[float, float]:
        """``(cudnn_ms, pytorch_ms)`` of this plan against the PyTorch ops it replaces.

        ``measure()`` runs only when the plan was built now or the cache holds no record named
        ``record_name`` for it (name a new method of measuring anew); its result is stored
        beside the plan in the cache, and a plan loaded from the cache reuses the stored timing,
        so warm compiles skip the timing and every process makes the same choice for the same
        plan. A plan that follows a choice made at another batch size reuses that batch size's
        timing (the same decision, nothing timed).
        """
        cache = self.backend.cache
        record = cache.load_record(self.header, record_name) if self.from_cache else None
        if record is None and self.reused_from:
            record = (self.backend.choice_for(self.recipe, self.device) or {}).get(record_name)
        if record is not None:
            return float(record["cudnn_ms"]), float(record["pytorch_ms"])
        cudnn_ms, pytorch_ms = measure()
        record = {"cudnn_ms": cudnn_ms, "pytorch_ms": pytorch_ms}
        cache.store_record(self.header, record_name, record)
        choice = self.backend.choice_for(self.recipe, self.device)
        if choice is not None and not self.reused_from:
            self.backend.remember_choice(self.recipe, self.device, {**choice, record_name: record})
        return cudnn_ms, pytorch_ms

    def execute(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Run the plan: ``inputs``/``outputs`` in the graph's input/output order, laid out as
        declared (fully packed NHWC for 4-d tensors), on the current torch stream, with the
        backend's workspace of the device.

        The operands go to the frontend as a list with their UIDs fixed at construction
        (``execute(..., tensor_uids=...)``, cuDNN frontend 1.32: it caches the operands'
        metadata by UID instead of reading a dict each call); older frontends get the dict."""
        ws = self.backend.workspace(self.device, self.workspace_bytes)
        handle = self.backend.handle(self.device)
        if self._ordered:
            self.graph.execute([*inputs, *outputs, *self._constant_values], ws, handle=handle,
                               tensor_uids=self._uids)
            return
        pack = dict(zip(self.input_uids, inputs))
        pack.update(zip(self.output_uids, outputs))
        pack.update(self.constants)
        self.graph.execute(pack, ws, handle=handle)
