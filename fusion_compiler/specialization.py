"""One specialization: the model compiled for one input signature, and how it is built.

Capture, then the pre-fusion and fusion pipelines (shapes from the shape cache where it has
them), lowering, the post-lowering pipeline, and the runner (:mod:`.runners`). With ``tiered``, a
call that compiles a specialization whose plans must be built answers from tier 0 (its regions'
own PyTorch ops) while the background thread builds them (:meth:`SpecializationCompiler.build`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .backends.timing import timing_deferred
from .capture import capture, unpack_inputs
from .config import CompileOptions, Target
from .ir.errors import FusionError, TimingDeferred
from .ir.ops import is_any_conv
from .ir.region import Region, called_region
from .kernels import prewarm_triton
from .lowering import build_plans, lower, plan_work, regions_of
from .passes import PassManager, fusion, post_lowering, pre_fusion
from .passes.post_lowering.hoist import HOISTED, HoistedParameters
from .runners import Runners, memory_format, with_formats
from .runtime.tensors import output_leaves
from .runtime.plan_cache import PlanCache, default_cache_dir
from .runtime.background import COMPILE_LOCK, warn_once
from .runtime.tiered import TieredRunner, unlowered_copy
from .runtime.tensors import stream_capturing

__all__ = ["Specialization", "SpecializationCompiler"]

log = logging.getLogger("fusion_compiler")


@functools.cache
def source_digest() -> str:
    """A hash of this package's Python sources (hex, 16 digits). Shape tables on disk are keyed by
    it: a table holds the values of a graph's nodes by name, and a pass changed without a new
    version number (an editable install, a patched copy) can leave another graph whose node
    names, ops and targets match, which the stale values would then mislead (seen: a weight given
    an activation's shape). Read once per process (about a hundred files); the version number is
    hashed too (an install whose sources are not files, such as a zip, has only that)."""
    from . import __version__  # noqa: PLC0415

    root = Path(__file__).parent
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class Specialization:
    """One compiled graph for one input signature.

    ``stages`` holds the code of the graph after capture and after each pass (by pass name; the
    post-lowering passes' too). ``glue_backend`` is the ``torch.compile`` backend its graph runs
    through (``None``: eager ops); ``cuda_graph`` whether its forward replays a CUDA graph
    (``"safe"``: outputs never overwritten by a later call) or not (``None``), and ``notes`` why a
    default was not taken (no Triton, capture impossible). ``lowered`` is ``False`` while a
    specialization a call compiled answers from tier 0 (its regions as PyTorch ops): its regions
    have no kernel yet, and ``glue_backend`` and ``cuda_graph`` are not decided. ``training``: its
    calls need gradients (it has a backward).
    """

    signature: tuple
    graph_module: fx.GraphModule
    run: Callable[..., Any]
    stages: dict[str, str]
    glue_backend: str | None = None
    cuda_graph: str | None = None
    notes: list[str] = field(default_factory=list)
    lowered: bool = True
    training: bool = False

    @property
    def regions(self) -> list[Region]:
        return regions_of(self.graph_module)

    def close(self) -> None:
        """Release what this specialization holds on the GPU: its CUDA graph (and the graph's
        memory pool) and, once nothing else refers to them, its regions' plans."""
        close = getattr(self.run, "close", None)
        if close is not None:
            close()
        self.run = _closed


def _closed(*args: Any) -> Any:
    raise RuntimeError("this specialization was evicted (max_specializations); call the "
                       "compiled module, not a specialization's run function")


class SpecializationCompiler:
    """Builds the specializations of one model.

    Args:
        model: the model (captured anew for each specialization).
        options: the compile's options.
        note: ``note(notes, reason)`` records why a default was not taken (and logs it once).
        names: the names of ``forward``'s arguments, in order.
    """

    def __init__(self, model: torch.nn.Module, options: CompileOptions,
                 note: Callable[[list[str], str], None], names: Sequence[str] = ()):
        self.model, self.options, self._note = model, options, note
        self.names = list(names)  # of forward's arguments, in order
        self.runners = Runners(model, options, note)
        self.shape_cache = PlanCache(default_cache_dir(options.cache_dir))  # shapes per input
        self._warned = False  # about a model without convolutions
        self._checkpointed = False  # warned that checkpoints are traced through

    def build(self, args: Sequence[Any], key: tuple, target: Target,
              requires: tuple[bool, ...], answer_early: bool,
              structure: Sequence[int | None] = ()) -> Specialization:
        """The specialization for inputs like ``args`` (signature ``key``; tuple inputs taken
        apart as ``structure`` says, :func:`~.capture.flatten_inputs`). With ``answer_early``
        (a call, not ``specialize``) it may answer from tier 0 until lowered
        (:meth:`_tier_before_lowering`)."""
        if target.cuda and stream_capturing():  # compiling times kernels, which waits
            raise FusionError(f"{type(self.model).__name__} was first called with these inputs "
                              "inside a CUDA graph capture, where it cannot compile: call it "
                              "once before the capture (as torch.cuda.graph's warm-up does)")
        stages: dict[str, str] = {}
        formats: list[torch.memory_format | None] = []
        if target.cuda:  # Triton's first launch (stem, SE and Inductor kernels) pays it
            prewarm_triton()

        def on_stage(name: str, g: fx.GraphModule) -> None:
            stages[name] = g.code
            if name == "captured":  # the memory formats eager returns, before any rewrite
                out = g.graph.find_nodes(op="output")[0]  # (a node's value may be a tuple)
                values = [n.meta.get("val") if isinstance(n, fx.Node) else n
                          for n in tree_flatten(out.args[0])[0]]
                formats.extend(memory_format(t) for t in output_leaves(values)[0]
                               if isinstance(t, torch.Tensor))

        with COMPILE_LOCK:  # never beside a background compile (see the lock's docstring)
            gm, lock = self._passes(key, args, target, on_stage, structure)
            self._warn_without_convolutions(gm)
            work = self._work_before_lowering(gm, target) if answer_early else ""
            if not work:
                hoisted = self._lower(gm, lock, target, requires, on_stage)
        spec = Specialization(key, gm, _closed, stages, training=target.training)
        if work:
            spec.lowered = False
            spec.run = self._tier_before_lowering(spec, args, lock, formats, target, on_stage,
                                                  work)
        else:
            spec.run, spec.glue_backend, spec.cuda_graph = self.runners.for_lowered(
                gm, spec.notes, args, hoisted, formats, target)
        return spec

    def _warn_without_convolutions(self, gm: fx.GraphModule) -> None:
        """Warn (once per model) that a model without a convolution gets nothing fused, or (once
        per cause) that its graph runs as PyTorch ops for the reason ``normalize`` gave."""
        if gm.meta.get("fusion_off"):
            warn_once(f"fusing {type(self.model).__name__}", f"{gm.meta['fusion_off']}: its "
                      "graph runs as PyTorch ops")
        if self._warned or any(is_any_conv(n, gm) or called_region(gm, n) is not None
                               for n in gm.graph.nodes):
            return
        self._warned = True
        # a Dynamo graph without one is common (the tail after a graph break): no warning
        level = logging.INFO if isinstance(self.model, fx.GraphModule) else logging.WARNING
        log.log(level, "%s has no convolution: nothing will be fused (fusion_compiler fuses "
                "convolution chains); it runs as its own PyTorch ops", type(self.model).__name__)

    def _passes(self, key: tuple, args: Sequence[Any], target: Target,
                on_stage: Callable[[str, fx.GraphModule], None],
                structure: Sequence[int | None] = ()) -> tuple[fx.GraphModule, str]:
        """The model captured and rewritten by the pre-fusion and fusion pipelines (shapes from
        the shape cache where it has them), and the name of the lock :meth:`_lower` takes."""
        passes = [*pre_fusion(self.options, target), *fusion(self.options, target)]
        # an argument passed as None is traced as None (``if mask is not None``)
        whole = iter(args)  # the arguments as forward takes them: a tuple is not None
        given = [next(whole) if n is None else tuple(next(whole) for _ in range(n))
                 for n in structure] if structure else args
        captured = capture(self.model, [n for n, a in zip(self.names, given) if a is None],
                           target.grad_enabled,
                           {n: a.dim() for n, a in zip(self.names, given)
                            if isinstance(a, torch.Tensor)})
        if target.training and captured.meta.get("checkpoints") and not self._checkpointed:
            self._checkpointed = True
            log.warning("%s.forward calls torch.utils.checkpoint: compile(model) traces through "
                        "it, so training keeps the checkpointed activations for the backward "
                        "instead of recomputing them (no memory is saved; a batch norm inside "
                        "updates its statistics once per step, where eager's recompute updates "
                        "them twice)",
                        type(self.model).__name__)
        if structure:
            unpack_inputs(captured, structure)
        text = self._shapes_text(captured, key, passes)
        shapes_header = PlanCache.header(text, {"kind": "shapes"})
        # Processes sharing the cache directory (DDP ranks) compile this one at a time: the
        # first builds and tunes, the others find its plans and choices and run the same plans.
        # The lock ignores the device index (each rank has its own GPU); the shapes do not
        # (their recorded devices say where plans run).
        lock = PlanCache.header(re.sub(r"\bcuda:\d+", "cuda", text), {"kind": "compile"})
        # shapes after a user's pass depend on its code, which the cache header does not hold
        cached = not self.options.custom_passes("pre_fusion")
        with self.shape_cache.lock(lock, f"compile {type(self.model).__name__}"):
            known = self.shape_cache.load_record(shapes_header, "shapes") if cached else None
            manager = PassManager(passes, args, on_stage=on_stage, known_shapes=known)
            gm = manager.run(captured)
            if manager.recorded and cached:
                self.shape_cache.store_record(shapes_header, "shapes",
                                              {**(known or {}), **manager.recorded})
        return gm, lock

    def _lower(self, gm: fx.GraphModule, lock: str, target: Target, requires: tuple[bool, ...],
               on_stage: Callable[[str, fx.GraphModule], None] | None = None,
               progress: bool | None = None) -> HoistedParameters | None:
        """Give every region of ``gm`` its kernel (:func:`~fusion_compiler.lowering.lower`, under
        the compile lock ``lock`` shared with other processes), then run the post-lowering
        pipeline; returns the hoisted parameter subgraphs, or ``None``."""
        frozen = frozenset(ph.name for ph, needs in zip(
            gm.graph.find_nodes(op="placeholder"), requires) if not needs)
        with self.shape_cache.lock(lock, f"compile {type(self.model).__name__}"):
            lower(gm, self.options, training=target.training, no_grad_inputs=frozen,
                  progress=progress)
        PassManager(post_lowering(self.options, target), on_stage=on_stage,
                    propagate=False).run(gm)
        return gm.meta.get(HOISTED)

    def _shapes_text(self, captured: fx.GraphModule, key: tuple, passes: Sequence[Any]) -> str:
        """What the shapes propagated through ``passes`` for this model and specialization
        ``key`` depend on, as text (hashed into their cache header): the traced code, the module
        tree with each module's configuration, parameter and buffer metadata, the inputs, the
        passes and their options, the version of torch and :func:`source_digest`."""
        state = [(name, tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
                 for name, t in (*self.model.named_parameters(), *self.model.named_buffers())]
        steps = [(p.name, sorted(getattr(p.fn, "keywords", {}).items(), key=str)) for p in passes]
        return repr((torch.__version__, source_digest(), captured.code, repr(self.model), state,
                     key, steps))

    def _work_before_lowering(self, gm: fx.GraphModule, target: Target) -> str:
        """What a specialization a call compiles would wait for before its first output, if
        anything, when tier 0 may answer meanwhile (:meth:`_tier_before_lowering`): plans to
        build (``"build"``) or to build and time (``"tune"``), see
        :func:`~fusion_compiler.lowering.plan_work`; ``"load"`` when every plan is in the cache
        (tier 0 answers while the background thread loads them: docs/decisions.md, "A warm start
        answers from tier 0 too"). Without tier 0 (not CUDA inference in a CUDA graph, autocast,
        or ``tiered`` off) ``""``: lower at once."""
        if not self.options.tiers_before_lowering(target):
            return ""
        return plan_work(gm, self.options) or "load"

    def _tier_before_lowering(self, spec: Specialization, args: Sequence[Any], lock: str,
                              formats: list[torch.memory_format | None], target: Target,
                              on_stage: Callable[[str, fx.GraphModule], None],
                              work: str) -> TieredRunner:
        """Tier 0: calls of ``spec`` answered by its regions' own PyTorch ops
        (:func:`~fusion_compiler.runtime.tiered.unlowered_copy`, eager, no CUDA graph) while the
        background thread does what lowering can do beside them, with nothing run on the GPU:

        - when lowering times nothing (``work`` ``"load"``: every plan is cached; ``"build"``:
          each follows the choice made at a batch size within a factor of 2, or
          ``autotune <= 1``), the whole lowering (plans built in worker processes where missing,
          deserialized) and the post-lowering pipeline;
        - otherwise (``"tune"``, or when the user gave post-lowering passes, their code not
          being for the background thread) only the candidate plans' builds in worker
          processes (:func:`~fusion_compiler.lowering.build_plans`): the rest (timing, which
          must not share the GPU with the caller's work) is left to the switch.

        The background lowering runs under
        :func:`~fusion_compiler.backends.timing.timing_deferred`: should it need a timing after
        all (cuDNN rejected a reused choice's engine, which is then tuned), it stops, and the
        switch lowers again, timing on the calling thread.

        The first call after that switches on the calling thread: it lowers (timing the
        candidates, when left to it), then captures the lowered graph
        (:meth:`.runners.Runners.for_lowered`, itself tiered when Inductor compiles the glue)."""
        gm = spec.graph_module
        example = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        first = with_formats(unlowered_copy(gm), formats)
        # a user's post-lowering pass is code of theirs: it runs on the calling thread (the rule
        # of runtime.background), so the background thread only builds plans then
        timed = work == "tune" or bool(self.options.custom_passes("post_lowering"))
        log.info("%s answers from PyTorch ops while its plans are %s in the background",
                 type(self.model).__name__,
                 {"tune": "built", "build": "built and loaded"}.get(work, "loaded"))

        def build() -> tuple[HoistedParameters | None] | None:  # on the background thread
            with COMPILE_LOCK:  # no progress bar unless asked for: the caller's calls go on
                if timed:
                    build_plans(gm, self.options)
                    return None
                try:
                    with timing_deferred():
                        return (self._lower(gm, lock, target, (), on_stage,
                                            progress=bool(self.options.progress)),)
                except TimingDeferred:  # a reused choice cuDNN rejected must be tuned: lowered
                    return None  # again at the switch (plans built so far come from the cache)

        def finish(lowered: tuple[HoistedParameters | None] | None) -> Callable[..., Any]:
            if lowered is None:  # times the candidates built meanwhile
                with COMPILE_LOCK:
                    lowered = (self._lower(gm, lock, target, (), on_stage),)
            spec.lowered = True
            runner, spec.glue_backend, spec.cuda_graph = self.runners.for_lowered(
                gm, spec.notes, example, lowered[0], formats, target)
            return runner

        def failed(reason: str) -> None:
            warn_once(f"lowering {type(self.model).__name__}'s regions", reason)
            self._note(spec.notes, f"lowering failed; the regions run as PyTorch ops: {reason}")

        return TieredRunner(first, build, finish, failed)
