"""``fusion_compiler.compile``: capture -> passes -> lowering -> runtime, specialized per input signature."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from .backends.timing import timing_deferred
from .backends.cudnn.backend import DEFAULT_AUTOTUNE
from .capture import TensorSpec, capture, input_specs
from .ir.errors import TimingDeferred
from .lowering import build_plans, lower, plan_work, regions_of
from .passes import Pass, PassManager, default_passes
from .passes.pre_fusion.autocast import make_autocast_explicit
from .passes.glue import se_gates, small_linears_as_reductions
from .ir.region import Region
from .passes.post_lowering.hoist import HoistedParameters, hoist_parameter_subgraphs
from .passes.post_lowering.layout import (channel_padded_images, channels_last_activations, four_channel_images,
                             nchw_padded_avg_pools)
from .runtime.plan_cache import PlanCache, default_cache_dir
from .kernels.space_to_depth import space_to_depth_stems
from .passes.post_lowering.streams import run_short_branches_beside
from .runtime.tiered import COMPILE_LOCK, TieredRunner, drain, isolated_copy, unlowered_copy

__all__ = ["compile", "CompiledModule", "CUDA_GRAPH_MODES", "DEFAULT_MAX_SPECIALIZATIONS"]

log = logging.getLogger("fusion_compiler")

CUDA_GRAPH_MODES = ("auto", "static", True, False)
DEFAULT_MAX_SPECIALIZATIONS = 16


@dataclass
class Specialization:
    """One compiled graph for one input signature.

    ``glue_backend`` is the ``torch.compile`` backend its graph runs through (``None``: eager ops);
    ``cuda_graph`` whether its forward replays a CUDA graph (``"static"``, ``"safe"``) or not
    (``None``), and ``notes`` why a default was not taken (no Triton, capture impossible).
    ``lowered`` is ``False`` while a specialization a call compiled answers from tier 0 (its
    regions as PyTorch ops, see ``tiered`` in :func:`compile`): its regions have no kernel yet,
    and ``glue_backend`` and ``cuda_graph`` are not decided.
    """

    signature: tuple
    graph_module: fx.GraphModule
    run: Callable[..., Any]
    stages: dict[str, str]
    glue_backend: str | None = None
    cuda_graph: str | None = None
    notes: list[str] = field(default_factory=list)
    lowered: bool = True

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


def _with_hoisting_and_formats(call: Callable[..., Any], hoisted: HoistedParameters | None,
                               formats: list[torch.memory_format | None]) -> Callable[..., Any]:
    """``call`` after refreshing ``hoisted`` (parameter subgraphs computed out of the graph), its
    outputs in the memory formats eager returned (``formats``: one per output, ``None`` where any
    format goes)."""
    def run(*inputs: Any) -> Any:
        if hoisted is not None:
            hoisted.refresh()
        out = call(*inputs)
        if not any(f is not None for f in formats):
            return out
        flat = iter(formats)
        return tree_map(lambda t: t.contiguous(memory_format=f)
                        if (f := next(flat)) is not None
                        and not t.is_contiguous(memory_format=f) else t, out)
    return run


@functools.cache
def _triton_reason() -> str:
    """Why Inductor cannot compile CUDA glue here (``""``: it can): Triton must import and the GPU
    must have compute capability 7.0 or newer (what Inductor's Triton backend needs)."""
    try:
        import triton  # noqa: F401, PLC0415
    except Exception as exc:  # ImportError, or a broken install
        return f"Triton does not import ({type(exc).__name__}: {exc})"
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return f"the GPU has compute capability {major}.{minor}; Inductor's Triton kernels need 7.0"
    return ""


def _inductor_compile(gm: fx.GraphModule, example: Sequence[Any]) -> Callable[..., Any]:
    """``gm`` compiled by Inductor for inputs like ``example`` (static shapes), without Dynamo.

    Called bare, ``torch._inductor.compile`` makes a fake-tensor mode without a shape
    environment, and Inductor's FX graph cache then bypasses every graph ("No shape env"), so a
    warm process compiled the glue from scratch. Here the compile runs in a tracing context whose
    fake mode has one, on inputs made fake with static shapes (as Dynamo hands them to a
    backend), so the graph is looked up in and written to the cache
    (``TORCHINDUCTOR_CACHE_DIR``): on an H100 a second process hit it, and SE-ResNet9's warm
    "Inductor glue in" time went from 7.0-10 s to 5.2-6.1 s (``examples/benchmark.py``).
    """
    from torch._guards import TracingContext, tracing  # noqa: PLC0415
    from torch._inductor import compile as inductor_compile  # noqa: PLC0415
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
             for a in example]
    with tracing(TracingContext(fake_mode)):
        return inductor_compile(gm, fakes)


def _without_custom_op_alias_check() -> contextlib.AbstractContextManager[Any]:
    """A context for the first call of a graph Inductor compiled, the call in which Inductor's
    Triton kernels autotune (each benchmarks its configs at its first launch).

    AOTAutograd runs a compiled graph's first call under a dispatch mode that checks the outputs
    of custom ops (here ``run_region``) for aliasing (``torch._functorch.config.
    check_custom_op_aliasing``). Under it every op of Inductor's benchmark loop (the L2 flush,
    the event records) goes through Python: on an H100 a small ``zero_`` took 38 us instead of
    8, the host launched slower than the kernels ran, and each config of a 3-9 us reduction timed
    0.10-0.23 ms, so configs were picked at random: in 2 of 5 SE-ResNet9 compiles one SE squeeze
    got XBLOCK=1 and took 20.7 us per forward where XBLOCK=8 takes 3.6 (Inductor's autotune
    debug log, torch 2.11). With the check off for that call the timings match a re-benchmark
    after it (8-9 us with the launch; 4 of 4 compiles then chose the 2.1 us config), and the
    check runs at the next call instead (AOTAutograd keeps it pending). A no-op on a torch
    without that option. The option is process-wide (``config.patch`` saves and restores it),
    so this is used only where no other thread patches it meanwhile: the background compile
    holds :data:`~fusion_compiler.runtime.tiered.COMPILE_LOCK`, and a glue compile on the
    calling thread first waits for the background ones (``tiered.drain``).
    """
    from torch._functorch import config  # noqa: PLC0415

    if not hasattr(config, "check_custom_op_aliasing"):
        return contextlib.nullcontext()
    return config.patch(check_custom_op_aliasing=False)


def _memory_format(t: Any) -> torch.memory_format | None:
    """The memory format eager returned for an output (``None``: leave it as it comes)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return None
    if t.is_contiguous():
        return torch.contiguous_format
    if t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def _autocast_dtype(args: Sequence[Any]) -> torch.dtype | None:
    """The ``torch.autocast`` dtype active for the device of the first tensor input, or ``None``."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


class CompiledModule(torch.nn.Module):
    """What :func:`compile` returns: computes ``model``'s function through fused regions.

    It shares ``model``'s parameters and buffers (``parameters()``, ``state_dict()`` and
    ``train()``/``eval()`` act on the model). A call whose inputs differ in shape, stride, dtype or
    device from every earlier one compiles a new specialization (``specializations`` lists them).
    A call under ``torch.autocast`` gets its own specialization in which the autocast casts are
    explicit graph ops (:mod:`.passes.autocast`), so regions form in the autocast dtype.
    Calls that need gradients (grad mode on and a parameter or input requiring grad) get their own
    training specialization, whose cuDNN regions run a fused backward (:mod:`.backward`).
    ``derived_backward`` makes PyTorch-backend regions use that backward too (for tests).
    ``glue_backend`` hands each specialization's graph to ``torch.compile`` with that backend,
    ``cuda_graph`` replays forwards (and training backwards) as CUDA graphs, and at most
    ``max_specializations`` are kept, the least recently used evicted first (see :func:`compile`
    for all three). ``passes`` (default: :func:`~fusion_compiler.passes.default_passes` for the
    inputs' device) is the pass pipeline.

    Raises (on call):
        TypeError: wrong number of inputs, or a floating input whose dtype differs from the
            model's parameters (expected and actual dtypes are in the message).
        ValueError: an input on another device than the model's parameters.
        FusionError: the graph cannot be captured or breaks the cuDNN graph rules.
    """

    def __init__(self, model: torch.nn.Module, *, backend: str = "auto",
                 cuda_graph: bool | str = "auto", cache_dir=None,
                 autotune: int = DEFAULT_AUTOTUNE, fuse_prologue: bool = False,
                 fuse_reduction: bool = False, passes: Sequence[Pass] | None = None,
                 report: bool = False, progress: bool | None = None,
                 derived_backward: bool = False, glue_backend: str | None = "auto",
                 max_specializations: int = DEFAULT_MAX_SPECIALIZATIONS, tiered: bool = True,
                 concurrent_branches: bool = False):
        super().__init__()
        if cuda_graph not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graph must be one of {CUDA_GRAPH_MODES}, got {cuda_graph!r}")
        if max_specializations < 1:
            raise ValueError(f"max_specializations must be at least 1, got {max_specializations}")
        self.derived_backward = derived_backward
        self.glue_backend = glue_backend
        self.tiered = tiered
        self.concurrent_branches = concurrent_branches
        self.model = model
        self.backend = backend
        self.cuda_graph = "auto" if cuda_graph is True else cuda_graph
        self.max_specializations = max_specializations
        self.cache_dir = cache_dir
        self.autotune = autotune
        self.passes = list(passes) if passes is not None else None  # None: default_passes
        self._fuse_options = {"fuse_prologue": fuse_prologue, "fuse_reduction": fuse_reduction}
        self.show_report = report
        self.progress = progress
        self._arity = len(capture(model).graph.find_nodes(op="placeholder"))  # fail early
        self.specializations: collections.OrderedDict[tuple, Specialization] = \
            collections.OrderedDict()
        self.last: Specialization | None = None
        self._noted: set[str] = set()  # reasons already logged (each once per module)
        self._shape_cache = PlanCache(default_cache_dir(cache_dir))  # shapes per specialization

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, args: Sequence[Any]) -> None:
        if len(args) != self._arity:
            raise TypeError(f"expected {self._arity} inputs, got {len(args)}")
        ref = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        if ref is None:
            return
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            if a.device != ref.device:
                raise ValueError(f"input {i} is on {a.device} but the model's parameters are on "
                                 f"{ref.device}; move the input (or the model) first")
            if a.is_floating_point() and a.dtype != ref.dtype and _autocast_dtype(args) is None:
                raise TypeError(f"input {i} has dtype {a.dtype} but the model's parameters are "
                                f"{ref.dtype}; convert the input to {ref.dtype}")

    def _needs_grad(self, args: Sequence[Any]) -> bool:
        if not torch.is_grad_enabled():
            return False
        return any(p.requires_grad for p in self.model.parameters()) or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    # ------------------------------------------------------------------ compile
    def specialize(self, *args: Any) -> Specialization:
        """Compile (or fetch) the specialization for inputs like ``args``, lowered now: a
        specialization that a call compiled and that still answers from tier 0 is waited for
        (see ``tiered`` in :func:`compile`; Inductor's tier may still be compiling)."""
        spec = self._specialize(args, answer_early=False)
        if not spec.lowered and isinstance(spec.run, TieredRunner):
            spec.run.wait(nested=False)
        return spec

    def _specialize(self, args: Sequence[Any], answer_early: bool) -> Specialization:
        """The specialization for inputs like ``args``, compiled if there is none; with
        ``answer_early`` (a call) it may answer from tier 0 until lowered
        (:meth:`_tier_before_lowering`)."""
        self._check_inputs(args)
        grad = self._needs_grad(args)
        requires = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        amp = _autocast_dtype(args)
        key = (input_specs(args), self.model.training, grad, requires if grad else (), amp)
        spec = self.specializations.get(key)
        if spec is not None:
            self.specializations.move_to_end(key)
            return spec
        log.info("compiling %s for inputs %s", type(self.model).__name__,
                 ", ".join(str(s) for s in key[0] if isinstance(s, TensorSpec)))
        stages: dict[str, str] = {}
        formats: list[torch.memory_format | None] = []

        def on_stage(name: str, g: fx.GraphModule) -> None:
            stages[name] = g.code
            if name == "captured":  # the memory formats eager returns, before any rewrite
                out = g.graph.find_nodes(op="output")[0]
                formats.extend(_memory_format(n.meta.get("val") if isinstance(n, fx.Node) else n)
                               for n in tree_flatten(out.args[0])[0])

        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        passes = self.passes if self.passes is not None else default_passes(
            **self._fuse_options, cuda=on_cuda,
            concurrent_branches=self._concurrent(on_cuda, grad))
        if amp is not None:  # casts before the fuse pass, so regions form in the autocast dtype
            at = next((i for i, p in enumerate(passes) if p.name == "fuse"), len(passes))
            passes = [*passes[:at], Pass("autocast", functools.partial(make_autocast_explicit,
                                                                        dtype=amp)), *passes[at:]]
        with COMPILE_LOCK:  # never beside a background compile (see the lock's docstring)
            gm, lock = self._passes(key, args, passes, on_stage)
            work = (self._work_before_lowering(gm, grad, amp, on_cuda) if answer_early
                    else "")
            if not work:
                hoisted = self._lower(gm, lock, grad, requires, on_cuda)
        spec = Specialization(key, gm, _closed, stages)
        if work:
            spec.lowered = False
            spec.run = self._tier_before_lowering(spec, args, lock, formats, on_cuda,
                                                  timed=work == "tune")
        else:
            spec.run = self._runner(spec, args, hoisted, formats, grad, amp, on_cuda)
        self.specializations[key] = spec
        while len(self.specializations) > self.max_specializations:
            old_key, old = self.specializations.popitem(last=False)
            old.close()
            log.info("evicted the specialization for inputs %s (max_specializations=%d)",
                     ", ".join(str(s) for s in old_key[0] if isinstance(s, TensorSpec)),
                     self.max_specializations)
        if self.show_report and not work:
            self._print_report(spec, grad)
        return spec

    def _graphed_inference(self, on_cuda: bool, grad: bool) -> bool:
        """Whether a specialization is CUDA inference in a CUDA graph: what tiering and
        concurrent branches apply to."""
        return on_cuda and not grad and bool(self.cuda_graph)

    def _concurrent(self, on_cuda: bool, grad: bool) -> bool:
        """Whether short branches run on a second stream (``concurrent_branches``): CUDA
        inference in a CUDA graph."""
        return self.concurrent_branches and self._graphed_inference(on_cuda, grad)

    def _print_report(self, spec: Specialization, grad: bool) -> None:
        from .tools.report import format_gradients, format_regions  # noqa: PLC0415

        print(format_regions(spec.regions))
        if grad:
            print(format_gradients(spec.regions))

    def _runner(self, spec: Specialization, args: Sequence[Any],
                hoisted: HoistedParameters | None, formats: list[torch.memory_format | None],
                grad: bool, amp: torch.dtype | None, on_cuda: bool) -> Callable[..., Any]:
        """What calls of the lowered ``spec.graph_module`` go through: its glue compiled by
        ``glue_backend`` (or on a background thread, :meth:`_tiered`), in a CUDA graph captured
        on ``args``. Sets ``spec.glue_backend`` and ``spec.cuda_graph``; appends to ``spec.notes``
        why a default was not taken."""
        gm, notes = spec.graph_module, spec.notes
        glue = self._glue_backend(on_cuda, ungraphed_inference=not grad and not self.cuda_graph,
                                  notes=notes)
        runner_for = functools.partial(_with_hoisting_and_formats, hoisted=hoisted,
                                       formats=formats)
        tiered = (self.tiered and glue == "inductor" and amp is None
                  and self._graphed_inference(on_cuda, grad))
        call = gm if glue is None or tiered else torch.compile(gm, backend=glue, fullgraph=True,
                                                               dynamic=False)
        runner, graphed = runner_for(call), None
        compiles_here = glue is not None and not tiered
        if compiles_here:  # one compile at a time: after the background ones
            drain()
        if self.cuda_graph and on_cuda:
            # the warm-up call compiles (and autotunes) a torch.compile'd glue; the option is
            # process-wide, so it is patched only then, with no background compile running
            with (_without_custom_op_alias_check() if compiles_here
                  else contextlib.nullcontext()):
                runner, graphed = self._graphed(runner, call, args, notes, training=grad)
        if tiered and graphed is None:  # no graph: eager glue is the faster one uncaptured
            glue = None
        elif tiered:
            runner = self._tiered(runner, gm, runner_for, notes)
        spec.glue_backend, spec.cuda_graph = glue, graphed
        return runner

    def _work_before_lowering(self, gm: fx.GraphModule, grad: bool, amp: torch.dtype | None,
                              on_cuda: bool) -> str:
        """What a specialization a call compiles would wait for before its first output, if
        anything, when tier 0 may answer meanwhile (:meth:`_tier_before_lowering`): plans to
        build (``"build"``) or to build and time (``"tune"``), see
        :func:`~fusion_compiler.lowering.plan_work`; ``""`` lowers at once (every plan is in the
        cache: loading them is quicker than tier 0's first eager call). Tier 0 is for CUDA
        inference specializations in a CUDA graph (not ``cuda_graph=False``), without autocast,
        with ``tiered``."""
        if not (self.tiered and amp is None and self._graphed_inference(on_cuda, grad)):
            return ""
        return plan_work(gm, self.backend, cache_dir=self.cache_dir, autotune=self.autotune)

    def _tier_before_lowering(self, spec: Specialization, args: Sequence[Any], lock: str,
                              formats: list[torch.memory_format | None], on_cuda: bool,
                              timed: bool) -> TieredRunner:
        """Tier 0: calls of ``spec`` answered by its regions' own PyTorch ops
        (:func:`~fusion_compiler.runtime.tiered.unlowered_copy`, eager, no CUDA graph) while the
        background thread does what lowering can do beside them, with nothing run on the GPU:

        - when lowering times nothing (``timed`` false: each plan follows the choice made at a
          batch size within a factor of 2, or ``autotune <= 1``), the whole lowering (plans
          built in worker processes, deserialized), the layout edits and the hoisting;
        - otherwise only the candidate plans' builds in worker processes
          (:func:`~fusion_compiler.lowering.build_plans`): their timing, which must not share
          the GPU with the caller's work, is left to the switch.

        The background lowering runs under :func:`~.backends.autotune.timing_deferred`: should
        it need a timing after all (cuDNN rejected a reused choice's engine, which is then
        tuned), it stops, and the switch lowers again, timing on the calling thread.

        The first call after that switches on the calling thread: it lowers (timing the
        candidates, when left to it), then captures the lowered graph (:meth:`_runner`, itself
        tiered when Inductor compiles the glue). On an H100, SE-ResNet9 RGB N=128's first output
        otherwise waited for its plans: about 6 s cold (most of it the CUDA driver compiling the
        runtime-generated kernels of 96 candidate plans), 1-2 s for a new batch size."""
        gm = spec.graph_module
        options = {"cache_dir": self.cache_dir, "autotune": self.autotune}
        example = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        first = _with_hoisting_and_formats(unlowered_copy(gm), None, formats)
        log.info("%s answers from PyTorch ops while its plans are %s in the background",
                 type(self.model).__name__, "built" if timed else "built and loaded")

        def build() -> tuple[HoistedParameters | None] | None:  # on the background thread
            with COMPILE_LOCK:  # no progress bar unless asked for: the caller's calls go on
                if timed:
                    build_plans(gm, self.backend, **options)
                    return None
                try:
                    with timing_deferred():
                        return (self._lower(gm, lock, False, (), on_cuda,
                                            progress=bool(self.progress)),)
                except TimingDeferred:  # a reused choice cuDNN rejected must be tuned: lowered
                    return None  # again at the switch (plans built so far come from the cache)

        def finish(lowered: tuple[HoistedParameters | None] | None) -> Callable[..., Any]:
            if lowered is None:  # times the candidates built meanwhile
                with COMPILE_LOCK:
                    lowered = (self._lower(gm, lock, False, (), on_cuda),)
            spec.lowered = True
            runner = self._runner(spec, example, lowered[0], formats, False, None, on_cuda)
            if self.show_report:
                self._print_report(spec, False)
            return runner

        def failed(reason: str) -> None:
            self._note(spec.notes, f"lowering failed; the regions run as PyTorch ops: {reason}")

        return TieredRunner(first, build, finish, failed)

    def _passes(self, key: tuple, args: Sequence[Any], passes: Sequence[Pass],
                on_stage: Callable[[str, fx.GraphModule], None]) -> tuple[fx.GraphModule, str]:
        """The model captured and rewritten by ``passes`` (shapes from the shape cache where it
        has them), and the name of the lock :meth:`_lower` takes."""
        captured = capture(self.model)
        text = self._shapes_text(captured, key, passes)
        shapes_header = PlanCache.header(text, {"kind": "shapes"})
        # Processes sharing the cache directory (DDP ranks) compile this one at a time: the
        # first builds and tunes, the others find its plans and choices and run the same plans.
        # The lock ignores the device index (each rank has its own GPU); the shapes do not
        # (their recorded devices say where plans run).
        lock = PlanCache.header(re.sub(r"\bcuda:\d+", "cuda", text), {"kind": "compile"})
        with self._shape_cache.lock(lock, f"compile {type(self.model).__name__}"):
            known = self._shape_cache.load_record(shapes_header, "shapes")
            manager = PassManager(passes, args, on_stage=on_stage, known_shapes=known)
            gm = manager.run(captured)
            if manager.recorded:
                self._shape_cache.store_record(shapes_header, "shapes",
                                               {**(known or {}), **manager.recorded})
        return gm, lock

    def _lower(self, gm: fx.GraphModule, lock: str, grad: bool, requires: tuple[bool, ...],
               on_cuda: bool, progress: bool | None = None) -> HoistedParameters | None:
        """Give every region of ``gm`` its kernel (:func:`~fusion_compiler.lowering.lower`, under
        the compile lock ``lock`` shared with other processes; in CUDA inference the Triton
        SpaceToDepth stems of :mod:`.runtime.space_to_depth`), then the layout edits of
        :mod:`.runtime.layout`, the hoisting of an inference graph's parameter subgraphs
        (:mod:`.runtime.hoist`) and, with :meth:`_concurrent`, the side stream's schedule
        (:mod:`.runtime.streams`); returns the hoisted subgraphs, or ``None``."""
        frozen = frozenset(ph.name for ph, needs in zip(
            gm.graph.find_nodes(op="placeholder"), requires) if not needs)
        with self._shape_cache.lock(lock, f"compile {type(self.model).__name__}"):
            lower(gm, self.backend, progress=self.progress if progress is None else progress,
                  training=grad, derived_backward=self.derived_backward, no_grad_inputs=frozen,
                  cache_dir=self.cache_dir, autotune=self.autotune)
        if (on_cuda and not grad and self.backend != "reference" and not _triton_reason()
                and (stems := space_to_depth_stems(gm))):
            log.info("regions %s run SpaceToDepth, conv and epilogue as one Triton kernel",
                     ", ".join(stems))
        if on_cuda:
            four_channel_images(gm)
            if not grad:
                channel_padded_images(gm)
        channels_last_activations(gm)
        if grad and on_cuda and (pools := nchw_padded_avg_pools(gm)):
            log.info("%d padded avg_pool2d input(s) made NCHW: PyTorch's channels_last CUDA "
                     "backward is wrong with padding (pytorch/pytorch#188344)", pools)
        hoisted = None if grad else hoist_parameter_subgraphs(gm)
        if self._concurrent(on_cuda, grad) and (beside := run_short_branches_beside(gm)):
            log.info("regions %s run on a second stream, beside a longer branch",
                     ", ".join(beside))
        return hoisted

    def _shapes_text(self, captured: fx.GraphModule, key: tuple, passes: Sequence[Pass]) -> str:
        """What the shapes propagated through ``passes`` for this model and specialization
        ``key`` depend on, as text (hashed into their cache header): the traced code, the module
        tree with each module's configuration, parameter and buffer metadata, the inputs, the
        passes and their options, the versions of torch and fusion_compiler."""
        from . import __version__  # noqa: PLC0415

        state = [(name, tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
                 for name, t in (*self.model.named_parameters(), *self.model.named_buffers())]
        steps = [(p.name, sorted(getattr(p.fn, "keywords", {}).items(), key=str)) for p in passes]
        return repr((torch.__version__, __version__, captured.code, repr(self.model), state,
                     key, steps))

    def _note(self, notes: list[str], reason: str) -> None:
        """Record why a default was not taken on the specialization; log it once per module."""
        notes.append(reason)
        if reason not in self._noted:
            self._noted.add(reason)
            log.info("%s", reason)

    def _glue_backend(self, on_cuda: bool, ungraphed_inference: bool,
                      notes: list[str]) -> str | None:
        """The ``torch.compile`` backend for this specialization's graph (``None``: eager ops).

        ``"auto"``: Inductor on CUDA when Triton imports (else eager ops, the reason noted),
        except for an inference forward run without a CUDA graph (``ungraphed_inference``):
        called from Python, each region is then one more dispatch of the ``run_region`` op from
        Inductor's code (about 20 us), while eager glue calls the plans directly; on an H100, SE-ResNet9 RGB
        N=128 took 1.916 ms with Inductor's glue and 1.360 ms with eager ops (eager PyTorch
        1.434 ms in the same run), depth C=11 N=512 1.625 and 1.431 ms (eager 1.488 ms).
        """
        if self.glue_backend != "auto":
            return self.glue_backend
        if not on_cuda or ungraphed_inference:
            return None
        reason = _triton_reason()
        if reason:
            self._note(notes, f"glue_backend='auto': ops between regions run eagerly: {reason}")
            return None
        return "inductor"

    def _tiered(self, first: Any, gm: fx.GraphModule,
                runner_for: Callable[[Callable[..., Any]], Callable[..., Any]],
                notes: list[str]) -> TieredRunner:
        """``first`` (the CUDA-graph runner of ``gm`` with eager glue) until ``gm`` compiled by
        Inductor on the background thread replaces it, in a CUDA graph of its own
        (:mod:`.runtime.tiered`).

        The graph goes to Inductor directly (``torch._inductor.compile``: AOTAutograd traces it,
        each region one ``run_region`` op), not through ``torch.compile``: Dynamo on one thread
        must not run beside Python on another (torch 2.11 keeps some of its per-call state
        process-wide, pytorch/pytorch#196637; here it compiled the calling thread's region
        calls as frames of their own until the recompile limit). It compiles an
        :func:`~fusion_compiler.runtime.tiered.isolated_copy` of ``gm``, which shares tensors with
        the model (in-place updates reach the compiled code) but no module, rewritten by
        :mod:`.passes.glue` (SE gates as one ``se_gate`` kernel each, small linear layers as
        reductions). The compiled graph then runs once on copies of the inputs, on a stream of
        its own, in the caller's grad and inference modes, with the regions not executed
        (:func:`~fusion_compiler.runtime.region_op.dry_run`): Triton's autotuning happens there.
        All of it holds :data:`~fusion_compiler.runtime.tiered.COMPILE_LOCK`: a new
        specialization's compile on the calling thread waits for it."""
        from .runtime.region_op import dry_run  # noqa: PLC0415

        example = [a.clone() if isinstance(a, torch.Tensor) else a for a in first.static_inputs]
        private = isolated_copy(gm, opaque=lambda m: isinstance(m, Region))
        se_gates(private)
        small_linears_as_reductions(private)
        device = next(a.device for a in example if isinstance(a, torch.Tensor))
        ready = torch.cuda.Event()
        ready.record()
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())

        def in_modes() -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode(modes[0]))
            stack.enter_context(torch.set_grad_enabled(modes[1]))
            return stack

        def build() -> Any:  # on the background thread; no capture may run meanwhile
            with COMPILE_LOCK:
                with in_modes(), torch.no_grad():  # an inference graph (no backward traced)
                    compiled = _inductor_compile(private, example)
                stream = torch.cuda.Stream(device)
                stream.wait_event(ready)
                with in_modes(), torch.cuda.stream(stream), dry_run(), \
                        _without_custom_op_alias_check():
                    compiled(*example)
                stream.synchronize()
            return compiled

        def finish(compiled: Any) -> Callable[..., Any]:  # on the calling thread
            with in_modes():
                runner, graphed = self._graphed(runner_for(compiled), compiled, example, notes)
            if graphed is None:
                raise RuntimeError("its CUDA graph could not be captured")
            return runner

        def failed(reason: str) -> None:
            self._note(notes, f"Inductor's glue failed to compile; eager glue kept: {reason}")

        return TieredRunner(first, build, finish, failed)

    def wait_for_background_compiles(self, timeout: float | None = None) -> bool:
        """Block until every specialization's background glue compile (see ``tiered`` in
        :func:`compile`) has ended, at most ``timeout`` seconds in all, and switch those
        specializations to their compiled glue now. Returns ``False`` if the timeout passed
        first. Benchmarks call it before timing the steady state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for spec in list(self.specializations.values()):
            if isinstance(spec.run, TieredRunner):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not spec.run.wait(left):
                    return False
        return True

    def _graphed(self, run: Callable[..., Any], module: torch.nn.Module, args: Sequence[Any],
                 notes: list[str], training: bool = False
                 ) -> tuple[Callable[..., Any], str | None]:
        """``run`` replayed as a CUDA graph (:mod:`.runtime.cuda_graph`; for a training
        specialization forward and backward graphs, :mod:`.runtime.cuda_graph_training`), or
        ``run`` itself when it cannot be captured (the reason is noted). ``module`` is what
        ``run`` calls (the graph module, or ``torch.compile``'s wrapper of it)."""
        from .runtime.cuda_graph import CaptureError, CudaGraphRunner  # noqa: PLC0415
        from .runtime.cuda_graph_training import TrainingGraphRunner  # noqa: PLC0415

        static = self.cuda_graph == "static"
        try:
            if training:
                runner = TrainingGraphRunner(run, module, args, list(self.model.parameters()),
                                             list(self.model.buffers()), copy_outputs=not static)
            else:
                params = [t for t in (*self.model.parameters(), *self.model.buffers())
                          if not t.is_inference()]
                runner = CudaGraphRunner(run, args,
                                         guard=lambda: tuple(p._version for p in params),
                                         copy_outputs=not static)
        except CaptureError as exc:
            what = "training step" if training else "forward"
            self._note(notes, f"the {what} runs without a CUDA graph: {exc}")
            return run, None
        return runner, "static" if static else "safe"

    def forward(self, *args: Any) -> Any:
        self.last = self._specialize(args, answer_early=True)
        return self.last.run(*args)

    def report(self) -> str:
        """The region table of the last specialization (as the CLI dump prints it)."""
        if self.last is None:
            return "not compiled yet: call the module once (or pass example_inputs)"
        from .tools.report import format_regions  # noqa: PLC0415

        return format_regions(self.last.regions)


def compile(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None, *,
            backend: str = "auto", cuda_graph: bool | str = "auto", cache_dir=None,
            autotune: int = DEFAULT_AUTOTUNE, fuse_prologue: bool = False,
            fuse_reduction: bool = False, report: bool = False,
            progress: bool | None = None, glue_backend: str | None = "auto",
            max_specializations: int = DEFAULT_MAX_SPECIALIZATIONS,
            tiered: bool = True, concurrent_branches: bool = False) -> CompiledModule:
    """Compile ``model`` into fused regions and return a module that computes the same function.

    Args:
        model: an ``nn.Module`` whose ``forward`` ``torch.fx.symbolic_trace`` can trace.
        example_inputs: compile for these inputs now (else on the first call).
        backend: ``"auto"`` (cuDNN where it takes a region, PyTorch ops elsewhere), ``"cudnn"``
            (same, but each fallback is a warning) or ``"reference"`` (PyTorch ops only).
        cuda_graph: ``"auto"`` (default; ``True`` is the same): on CUDA, every inference
            specialization captures its whole forward in one CUDA graph and each call replays it;
            nothing a call returned is overwritten by a later call (the graph's output buffers
            are returned while nothing holds the previous call's, else copies from a spare graph),
            and a call passing the previous call's input tensors again replays a graph that reads
            them in place (:mod:`~fusion_compiler.runtime.cuda_graph`). A forward that cannot be
            captured (a host synchronization, ``.item()``, a CPU tensor) runs without a graph,
            and the reason is logged once. ``"static"``: the same graph, but calls return the
            graph's own output buffers, overwritten by the next call (no copy: clone what you
            keep). ``False``: no CUDA graph. A training specialization is captured as a forward
            and a backward graph
            (:class:`~fusion_compiler.runtime.cuda_graph_training.TrainingGraphRunner`):
            gradients reach ``.grad`` through autograd; ``backward`` must follow its forward
            before the next call (else ``RuntimeError``).
        cache_dir: where serialized cuDNN plans are kept (default: ``$FUSION_COMPILER_CACHE_DIR``
            or the user cache directory; ``False`` disables the cache).
        autotune: per region, how many of cuDNN's ranked execution plans to build and time on
            random data of the region's shapes; the fastest is kept (and cached), and the region
            stays on PyTorch ops when those time at least 10% faster. ``1`` takes heuristics'
            first plan that builds and times nothing (fastest compile); region kinds known to run
            slowly on cuDNN then stay on PyTorch (``backends.cudnn.known_slow_on_cudnn``).
        fuse_prologue: fuse pointwise ops on a convolution's input (the Fixup ``x + bias``) into
            its region. Off by default: on an H100 with cuDNN 9.19 the fused kernel was 2-4x
            slower than the convolution plus a separate add (see ``passes.default_passes``).
        fuse_reduction: fuse the H, W sum after a convolution (the SE squeeze) into its region
            as an exit reduction. Off by default for the same reason.
        report: print the region table after each compilation (and, for a training
            specialization, how each region's backward runs).
        progress: progress bar while plans build (``None``: only on a terminal).
        glue_backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ...) for
            what is not a region: each specialization's graph, with every region an opaque
            ``fusion_compiler::run_region`` call, is compiled by it on its first call
            (``fullgraph=True, dynamic=False``). With ``"inductor"`` the PyTorch ops between
            regions (the SE gate, residual adds) fuse into Triton kernels, and in training so do
            the pointwise rules and bias sums of every region's backward, which AOTAutograd traces
            from the region's backward formula (dgrad and wgrad stay opaque cuDNN calls). Costs
            Inductor's compile time on the first call of each specialization. ``"auto"``
            (default): ``"inductor"`` for CUDA inputs when Triton imports (else eager PyTorch ops,
            the reason logged once), but eager ops for inference with ``cuda_graph=False``, where
            they were faster (see ``CompiledModule._glue_backend``); ``None``: eager PyTorch ops.
        max_specializations: how many specializations (input signatures) are kept; when one
            more is compiled, the least recently used is evicted (its CUDA graph, memory pool and
            plans freed, one INFO log line).
        tiered: for an inference specialization in a CUDA graph, answer the first calls at
            once and compile on one background thread, in tiers (:mod:`.runtime.tiered`):

            - tier 0, when a call (not :meth:`CompiledModule.specialize` or ``example_inputs``)
              compiles a specialization whose plans are not all in the plan cache: the regions
              run as their own PyTorch ops, eager, while worker processes build the plans; the
              first call after that lowers (timing the candidates then, on the calling thread,
              when they need timing) and captures the CUDA graph;
            - tier 1, the lowered regions with the glue as eager PyTorch ops in a CUDA graph,
              while Inductor compiles the glue (when ``glue_backend`` resolves to Inductor);
            - tier 2, the compiled glue's CUDA graph, from the first call after it is ready.

            The first output then waits neither for plan builds nor for Inductor (seconds each);
            outputs of different tiers may differ in the last bits.
            ``CompiledModule.wait_for_background_compiles()`` waits for the last tier.
            ``False``: the first call waits for everything. Training and ``torch.autocast``
            specializations always wait.
        concurrent_branches: in CUDA inference in a CUDA graph, a short branch's region (a
            downsample convolution beside its block's main path) runs on a second CUDA stream,
            in the same graph, and the join of the branches is left out of its region
            (:mod:`.runtime.streams`). Off by default: on an H100 it made SE-ResNet9 RGB N=128
            faster (0.123 against 0.146 ms) and depth N=512 slower (0.306 against 0.296 ms),
            where every convolution fills the GPU alone (README, ``concurrent_branches``);
            ``False``: one stream, the join fused into the region of whichever branch comes
            first.

    Training: a call that needs gradients compiles a training specialization whose cuDNN regions
    have a derived backward (dgrad and wgrad as cuDNN graphs, :mod:`fusion_compiler.backward`);
    under ``torch.autocast`` the autocast casts become graph ops (:mod:`.passes.autocast`).

    Raises:
        FusionError: the model cannot be traced or its graph breaks the cuDNN graph rules.
        ValueError: unknown ``backend`` or ``cuda_graph`` mode, ``max_specializations`` < 1.
    """
    from .lowering import BACKEND_CHOICES  # noqa: PLC0415

    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    compiled = CompiledModule(model, backend=backend, cuda_graph=cuda_graph, cache_dir=cache_dir,
                              autotune=autotune, fuse_prologue=fuse_prologue,
                              fuse_reduction=fuse_reduction, report=report, progress=progress,
                              glue_backend=glue_backend, max_specializations=max_specializations,
                              tiered=tiered, concurrent_branches=concurrent_branches)
    if example_inputs is not None:
        compiled.specialize(*example_inputs)
    return compiled
