"""Lowering: give every region of a fused graph a kernel from the backends that support it.

For each region the backends the ``backends`` option names (:mod:`fusion_compiler.backends`, in
its order; the reference, PyTorch ops, after them) say whether they take it. The first that does
lowers it; where several backends besides the reference take a region, each lowers it and their
kernels are timed against each other on the GPU (CUDA-graph timing on random inputs of the
region's shapes), the fastest kept and every candidate's time recorded; the choice is stored in the
plan cache (keyed by the region's ops and shapes, the candidates, the GPU and torch's version), so a
later compile of the same region times nothing. A backend may still
decline while lowering (:class:`~fusion_compiler.ir.errors.UnsupportedError`: cuDNN rejected the
graph, or its kernel timed slower than the region's PyTorch ops); the region then runs on the
reference backend, its record saying why; with other than the default ``backends``, each such
fallback is a warning. Where a backend declined because the region's PyTorch ops timed faster
and another backend's kernel was built, that kernel is timed against the PyTorch ops as well.
Every region also gets the graph JSON each backend can describe without running anything (cuDNN's,
also on a machine without a GPU), so dumps show what would run. Each region's record
(:class:`~fusion_compiler.ir.region.Lowering`) is written once, when every region has its kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx

from .autograd.backward import training_region
from .autograd.plan import backward_plans, with_masked_outputs
from .backends import (PLAN_WORK, REFERENCE, REUSE_BATCH_RATIO, Backend, Lowered, backends_for,
                       registered)
from .backends.glue_stand_in import eager_glue, pytorch_stand_in, timed_as
from .backends.timing import paired_time_ms, sample_inputs
from .config import DEFAULT_BACKENDS, CompileOptions
from .ir.errors import UnsupportedError, condense
from .ir.ops import node_device
from .ir.region import BackwardPlan, Lowering, Region, called_region
from .passes.glue import glue_compiled_expected
from .runtime.plan_cache import PlanCache, default_cache_dir

__all__ = ["lower", "plan_work", "build_plans", "regions_of"]

log = logging.getLogger("fusion_compiler")

_CHOICE = "backend_choice"  # the plan-cache record of the backend a region's timing chose


def regions_of(gm: fx.GraphModule) -> list[Region]:
    """The regions of a fused graph, in graph order."""
    return [r for n in gm.graph.nodes if (r := called_region(gm, n)) is not None]


@dataclass
class _Choice:
    """What lowering chose for one region, before its record is written."""

    backend: Backend
    lowered: Lowered
    reason: str = ""


def _candidates(region: Region, backends: list[Backend]) -> tuple[list[Backend], str]:
    """The backends besides the reference that take ``region``, in the asked order, and the first
    reason a backend gave for declining it (``""`` if none gave one)."""
    taking, reason = [], ""
    for backend in backends:
        if backend.name == REFERENCE:
            continue
        support = backend.supports(region)
        if support:
            taking.append(backend)
        elif not reason:
            reason = support.reason
    return taking, reason


def _asked(candidates: dict[Region, tuple[list[Backend], str]]) -> dict[Backend, list[Region]]:
    """The regions each backend will lower (every backend that takes a region lowers it), in
    graph order: what it may start preparing (:meth:`~fusion_compiler.backends.Backend.prefetch`)
    and what its :meth:`~fusion_compiler.backends.Backend.plan_work` is asked about."""
    mine: dict[Backend, list[Region]] = {}
    for region, (taking, _) in candidates.items():
        for backend in taking:
            mine.setdefault(backend, []).append(region)
    return mine


def _choice_header(region: Region, names) -> tuple[dict, int] | None:
    """The plan-cache header of the choice among the backends ``names`` for ``region``, and the
    region's batch size: the region's ops (targets and arguments, nodes by position) and input
    shapes (the batch dimension as ``"N"``) and dtypes, the candidates, the GPU and torch's
    version; ``None`` off CUDA (nothing is timed there)."""
    device = node_device(region.conv)
    if device.type != "cuda":
        return None
    batch = region.conv.meta["val"].shape[0]
    weight = region.conv.args[1]
    nodes = list(region.graph_module.graph.nodes)
    at = {node: i for i, node in enumerate(nodes)}
    ref = lambda a: f"%{at[a]}" if isinstance(a, fx.Node) else repr(a)  # noqa: E731

    def shape(node: fx.Node) -> list:
        dims = list(node.meta["val"].shape)
        if node is not weight and dims and dims[0] == batch:
            dims[0] = "N"
        return dims

    ops = [[node.op, shape(node), str(node.meta["val"].dtype)] if node.op == "placeholder" else
           [node.op, str(node.target), repr(fx.node.map_arg(node.args, ref)),
            repr(fx.node.map_arg(node.kwargs, ref))]
           for node in nodes]
    header = {"format": 1, "kind": _CHOICE, "region": ops, "candidates": sorted(names),
              "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if REFERENCE in names:  # a choice made against eager ops is not one against compiled glue
        header["reference"] = timed_as()
    return header, batch


def _stored_choices(cache: PlanCache, header: dict) -> dict:
    """The choices stored under ``header``: ``{batch size (text): {"winner", "ms"}}``."""
    record = cache.load_record(header, _CHOICE) or {}
    choices = record.get("by_batch")
    return choices if isinstance(choices, dict) else {}


def _followed(choices: dict, batch: int, names) -> dict | None:
    """The choice among ``names`` to follow at ``batch`` (``{"winner": name, "ms": {name:
    ms}}``): the one made at ``batch`` or, failing that, at the nearest batch size within
    :data:`~fusion_compiler.backends.REUSE_BATCH_RATIO` (then ``ms`` is empty: not timed at this
    size), as cuDNN's plans follow their engine choice; ``None`` when there is none."""
    near = sorted((abs(math.log2(int(n) / batch)), int(n)) for n in choices
                  if n.isdigit() and int(n) > 0
                  and max(int(n), batch) <= REUSE_BATCH_RATIO * min(int(n), batch))
    if not near:
        return None
    choice = choices[str(near[0][1])]
    if not isinstance(choice, dict) or choice.get("winner") not in names:
        return None
    return {"winner": choice["winner"],
            "ms": dict(choice.get("ms") or {}) if near[0][1] == batch else {}}


def _fastest(region: Region, lowered: dict[str, Lowered], cache: PlanCache
             ) -> tuple[str, dict[str, float]]:
    """The backend whose kernel ran ``region`` fastest on random inputs of its shapes (each
    kernel timed in a CUDA graph, the replays alternating), and every kernel's ms per call; a
    choice stored in ``cache`` (:func:`_followed`) is taken without timing, and a new one
    stored. Off CUDA, the first asked, with no times."""
    found = _choice_header(region, lowered)
    if found is None:
        return next(iter(lowered)), {}
    header, batch = found
    choices = _stored_choices(cache, header)
    record = _followed(choices, batch, lowered)
    if record is not None:
        return record["winner"], record["ms"]
    inputs = sample_inputs(region)
    runs = [pytorch_stand_in(region) if name == REFERENCE else low.kernel
            for name, low in lowered.items()]
    times = paired_time_ms([lambda k=run: k(*inputs) for run in runs])
    timing = dict(zip(lowered, times))
    winner = min(timing, key=timing.__getitem__)
    cache.store_record(header, _CHOICE, {"by_batch": {**choices, str(batch): {
        "winner": winner, "ms": timing}}})
    return winner, timing


def _timed_as_glue_runs(options: CompileOptions, gm: fx.GraphModule, training: bool):
    """The context a region's PyTorch ops are timed in for ``gm``: as compiled glue runs them
    (nothing to enter) or, where the glue will run eagerly, as themselves (:func:`eager_glue`)."""
    if glue_compiled_expected(options, gm, training):
        return contextlib.nullcontext()
    return eager_glue()


def _choose(region: Region, taking: list[Backend], reason: str, reference: Backend,
            training: bool, backward: BackwardPlan | None, cache: PlanCache) -> _Choice:
    """Lower ``region`` with the backends that take it (``taking``; ``reason``: why the others
    declined), see the module docstring."""
    lowered: dict[str, Lowered] = {}
    backend_of = {b.name: b for b in taking}
    declined: UnsupportedError | None = None
    for backend in taking:
        try:
            lowered[backend.name] = backend.lower(region, training, backward)
        except UnsupportedError as exc:  # the last (last asked, most general) backend's
            declined = exc  # decline is the one reported: e.g. cuDNN's, not "inference only"
    if not lowered:
        fallback = reference.lower(region, training, backward)
        if declined is not None:
            reason = declined.reason
            fallback = dataclasses.replace(fallback, timing=declined.timing,
                                           nhwc_inputs=declined.nhwc_inputs)
        return _Choice(reference, fallback, reason)
    if declined is not None and REFERENCE in declined.timing:
        # a backend timed the region's PyTorch ops faster than its kernel and declined: the
        # others' kernels are timed against those ops too (as they were against its kernel)
        backend_of[REFERENCE] = reference
        lowered[REFERENCE] = dataclasses.replace(
            reference.lower(region, training, backward), timing=declined.timing,
            nhwc_inputs=declined.nhwc_inputs)
    if len(lowered) == 1:
        name = next(iter(lowered))
        return _Choice(backend_of[name], lowered[name])
    name, timing = _fastest(region, lowered, cache)
    chosen = lowered[name]
    return _Choice(backend_of[name],
                   dataclasses.replace(chosen, timing={**chosen.timing, **timing}),
                   declined.reason if name == REFERENCE and declined is not None else "")


def lower(gm: fx.GraphModule, options: CompileOptions, *, training: bool = False,
          no_grad_inputs: frozenset[str] = frozenset(),
          progress: bool | None = None) -> fx.GraphModule:
    """Choose and build a kernel for every region of ``gm`` (in place); return ``gm``.

    Args:
        options: the compile's options (``backends``: which backends are asked; the backends
            read their own settings, e.g. ``autotune``, ``cache_dir``).
        training: kernels must be differentiable. Each region is first replaced by its
            :func:`~fusion_compiler.autograd.backward.training_region` (which also returns the
            values its backward reads), and its backward is planned
            (:mod:`fusion_compiler.autograd.plan`).
        no_grad_inputs: names of ``gm``'s placeholders whose values never need a gradient (a
            network input without ``requires_grad``): a convolution reading one, or a value
            computed from such inputs alone, builds no dgrad.
        progress: show a progress bar while kernels build (``None``: ``options.progress``, and
            when that is ``None``, only on a terminal).
    """
    backends = backends_for(options)
    reference = next(b for b in backends if b.name == REFERENCE)
    calls = [n for n in gm.graph.nodes if called_region(gm, n) is not None]
    plans: dict[Region, BackwardPlan] = {}
    pairs: dict[Region, tuple[Region, str]] = {}
    if training:
        for call in calls:
            setattr(gm, call.target, training_region(gm.get_submodule(call.target)))
        plans, pairs = backward_plans(gm, no_grad_inputs)
    regions = [gm.get_submodule(call.target) for call in calls]
    candidates = {r: _candidates(r, backends) for r in regions}
    describers = [r.make(options) for r in registered()]
    for backend, mine in _asked(candidates).items():  # plan builds start now, at once
        backend.prefetch(mine)
    shown = progress if progress is not None else options.progress
    bar = regions
    if shown or (shown is None and sys.stderr.isatty()):
        from tqdm.auto import tqdm  # noqa: PLC0415  (a slow import, only for a bar shown)

        bar = tqdm(regions, desc="fusion_compiler: building region plans", unit="region",
                   leave=False)
    cache = PlanCache(default_cache_dir(options.cache_dir))
    with _timed_as_glue_runs(options, gm, training):
        choices = {region: _choose(region, *candidates[region], reference, training,
                                   plans.get(region), cache) for region in bar}
    if training:  # only a derived backward masks: every backend's but PyTorch autograd's
        plans = with_masked_outputs(plans, pairs, lambda consumer: (
            choices[consumer].backend is not reference or options.derived_backward))
    for region, choice in choices.items():
        fallback = choice.backend is reference and bool(options.backends)
        low = choice.lowered
        region.set_lowering(Lowering(
            backend=choice.backend.name, status="fallback" if fallback else "lowered",
            kernel=None if low.kernel is region.graph_module else low.kernel,
            reason=(condense(choice.reason) or f"no backend of {', '.join(options.backends)} "
                    "takes this kind of region") if fallback else "", plan=low.plan,
            plan_from_cache=low.plan_from_cache, workspace_bytes=low.workspace_bytes,
            graphs={b.name: j for b in describers if (j := b.graph_json(region)) is not None},
            tuning=low.tuning, timing=low.timing, gradients=low.gradients,
            nhwc_inputs=low.nhwc_inputs, padded_images=low.padded_images,
            backward=plans.get(region)))
    _log_fallbacks([r for r in choices if r.status == "fallback"],
                   logging.INFO if options.backends == DEFAULT_BACKENDS else logging.WARNING)
    return gm


def _log_fallbacks(regions: list[Region], level: int) -> None:
    """One log line per reason the regions fell back to the reference backend for, naming
    them."""
    by_reason: dict[str, list[Region]] = {}
    for region in regions:
        by_reason.setdefault(region.reason, []).append(region)
    for reason, group in by_reason.items():
        names = ", ".join(f"{r.region_id} ({r.pattern})" for r in group[:4])
        more = f" and {len(group) - 4} more" if len(group) > 4 else ""
        log.log(level, "%s run%s on the reference backend: %s",
                f"region {names}" if len(group) == 1 else f"regions {names}{more}",
                "s" if len(group) == 1 else "", reason)


def _asked_in(gm: fx.GraphModule, options: CompileOptions
              ) -> tuple[dict[Backend, list[Region]], dict[Region, list[Backend]]]:
    """:func:`_asked` for the regions of ``gm`` and the backends of ``options``, and the
    backends besides the reference taking each region."""
    backends = backends_for(options)
    candidates = {r: _candidates(r, backends) for r in regions_of(gm)}
    return _asked(candidates), {r: taking for r, (taking, _) in candidates.items()}


def plan_work(gm: fx.GraphModule, options: CompileOptions) -> str:
    """The most that :func:`lower` of ``gm`` (inference) has to do for one region beyond loading
    cached plans (one of :data:`~fusion_compiler.backends.PLAN_WORK`, asked of every backend
    that would lower each region): ``""`` when every plan is in the plan cache, ``"build"`` when
    some must be built but nothing timed (CPU work in worker processes, which may run beside GPU
    work), ``"tune"`` when candidates must also be timed on the GPU (also where several backends
    take a region and no choice among them is stored)."""
    asked, taking = _asked_in(gm, options)
    with _timed_as_glue_runs(options, gm, False):
        work = [backend.plan_work(r) for backend, mine in asked.items() for r in mine]
    cache = PlanCache(default_cache_dir(options.cache_dir))
    for region, backends in taking.items():
        names = [b.name for b in backends]
        found = _choice_header(region, names) if len(names) > 1 else None
        if found is not None and _followed(_stored_choices(cache, found[0]), found[1],
                                           names) is None:
            work.append("tune")
            break
    return max(work, key=PLAN_WORK.index, default="")


def build_plans(gm: fx.GraphModule, options: CompileOptions) -> None:
    """Have each backend build, and wait for, what lowering ``gm`` (inference) will ask of it
    (:meth:`~fusion_compiler.backends.Backend.prefetch`: plans built in worker processes, CPU
    work, nothing run on the GPU). A later :func:`lower` finds them built and only loads and
    times them."""
    for backend, mine in _asked_in(gm, options)[0].items():
        backend.prefetch(mine)
        backend.wait_for_prefetched()

