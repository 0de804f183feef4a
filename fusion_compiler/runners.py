"""What the calls of a lowered specialization go through: its graph with the glue (the ops between
regions) as eager ops or compiled by a ``torch.compile`` backend (Inductor by default, on the
background thread when tiered), replayed as a CUDA graph. Why each default is what it is (with the
measurements): ``docs/decisions.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from .config import CompileOptions, Target
from .ir.region import Region
from .passes import PassManager, glue
from .passes.glue import inductor_work
from .passes.post_lowering.hoist import HoistedParameters
from .runtime.ddp_stages import ddp_bucket_caps, split_at, stage_boundaries
from .runtime.tiered import COMPILE_LOCK, TieredRunner, drain, isolated_copy

__all__ = ["Runners", "staged", "memory_format", "with_hoisting_and_formats", "inductor_reason",
           "inductor_compile", "inductor_without_autograd_cache", "without_custom_op_alias_check",
           "version_sum"]

log = logging.getLogger("fusion_compiler")


def memory_format(t: Any) -> torch.memory_format | None:
    """The memory format eager returned for an output (``None``: leave it as it comes)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return None
    if t.is_contiguous():
        return torch.contiguous_format
    if t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def with_hoisting_and_formats(call: Callable[..., Any], hoisted: HoistedParameters | None,
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


def version_sum(tensors: Sequence[torch.Tensor]) -> int:
    """The sum of the tensors' version counters (``Tensor._version``): counters only grow, so
    it changes whenever one of them is modified in place (an optimizer step, ``load_state_dict``),
    and it is read with one C-level pass per call, not a tuple built in Python."""
    return sum(map(_VERSION, tensors))


_VERSION = operator.attrgetter("_version")


@functools.cache
def inductor_reason() -> str:
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


def inductor_compile(gm: fx.GraphModule, example: Sequence[Any]) -> Callable[..., Any]:
    """``gm`` compiled by Inductor for inputs like ``example`` (static shapes), without Dynamo.

    Called bare, ``torch._inductor.compile`` makes a fake-tensor mode without a shape
    environment, and Inductor's FX graph cache then bypasses every graph ("No shape env"). Here
    the compile runs in a tracing context whose fake mode has one, on inputs made fake with
    static shapes (as Dynamo hands them to a backend), so the graph is looked up in and written
    to the cache (``TORCHINDUCTOR_CACHE_DIR``).
    """
    from torch._guards import TracingContext, tracing  # noqa: PLC0415
    from torch._inductor import compile as compile_inductor  # noqa: PLC0415
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
             for a in example]
    with tracing(TracingContext(fake_mode)):
        return compile_inductor(gm, fakes)


def without_custom_op_alias_check() -> contextlib.AbstractContextManager[Any]:
    """A context for the first call of a graph Inductor compiled, the call in which Inductor's
    Triton kernels autotune (each benchmarks its configs at its first launch).

    AOTAutograd runs a compiled graph's first call under a dispatch mode that checks the outputs
    of custom ops (here ``run_region``) for aliasing (``torch._functorch.config.
    check_custom_op_aliasing``); under it Inductor's benchmark loop runs through Python, the
    host launches slower than the kernels run and the configs' timings are noise. With the check
    off for that call the check runs at the next call instead (AOTAutograd keeps it pending). A
    no-op on a torch without that option. The option is process-wide (``config.patch`` saves
    and restores it), so this is used only where no other thread patches it meanwhile: the
    background compile holds :data:`~fusion_compiler.runtime.tiered.COMPILE_LOCK`, and a glue
    compile on the calling thread first waits for the background ones (``tiered.drain``).
    """
    from torch._functorch import config  # noqa: PLC0415

    if not hasattr(config, "check_custom_op_aliasing"):
        return contextlib.nullcontext()
    return config.patch(check_custom_op_aliasing=False)


def inductor_without_autograd_cache(gm: fx.GraphModule, example: Sequence[Any]) -> Any:
    """A ``torch.compile`` backend: Inductor (``compile_fx``) with AOTAutograd's cache off for
    this compile, for glue graphs whose regions are differentiated.

    AOTAutograd's cache is keyed by the graph Dynamo hands over, in which each region is
    ``run_region(key, ...)`` with its forward kernel's key. What the region's backward does is not
    in that graph: whether each gradient (dgrad, wgrad) runs a cuDNN plan, called by a key of its
    own, or PyTorch's ops is chosen by timing in each process, and the gradient kernels' keys are
    this process's. A cache entry another process wrote (a shared Inductor cache directory,
    another plan cache) would replay that process's backward here: a gradient key this process
    never registered (``KeyError`` in ``run_region``), or one naming another kernel. Without
    AOTAutograd's cache each process traces its own backward; Inductor's FX graph cache still
    serves the forward and backward graphs, whose text holds every key they call (docs/
    decisions.md, "AOTAutograd's cache off for training glue").
    """
    from torch._functorch import config  # noqa: PLC0415
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

    with config.patch(enable_autograd_cache=False):
        return compile_fx(gm, list(example))


def _glue_compiled(gm: fx.GraphModule, glue_backend: str,
                   training: bool) -> Callable[..., Any]:
    backend = (inductor_without_autograd_cache if training and glue_backend == "inductor"
               else glue_backend)
    return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)


def staged(gm: fx.GraphModule, starts: list[int], glue_backend: str | None) -> fx.GraphModule:
    """``gm`` split before the nodes ``starts`` (:func:`~fusion_compiler.runtime.ddp_stages.
    split_at`), each stage's graph compiled by ``glue_backend`` (``None``: eager ops) inside a
    :class:`~fusion_compiler.runtime.cuda_graph_training.Stage`."""
    from .runtime.cuda_graph_training import Stage  # noqa: PLC0415

    parent = split_at(gm, starts)
    for name, piece in list(parent.named_children()):
        if name.startswith("submod_"):
            setattr(parent, name, Stage(piece if glue_backend is None
                                        else _glue_compiled(piece, glue_backend, True)))
    return parent


class Runners:
    """Makes the runners of one model's specializations.

    Args:
        model: the compiled model (its parameters and buffers guard and feed the CUDA graphs).
        options: the compile's options (``glue_backend``, ``cuda_graph``, ``tiered``).
        note: ``note(notes, reason)`` records why a default was not taken (and logs it once).
    """

    def __init__(self, model: torch.nn.Module, options: CompileOptions,
                 note: Callable[[list[str], str], None]):
        self.model, self.options, self._note = model, options, note

    def glue_backend(self, gm: fx.GraphModule, target: Target, notes: list[str]) -> str | None:
        """The ``torch.compile`` backend for the lowered graph ``gm`` (``None``: eager ops).

        ``"auto"``: Inductor on CUDA when Triton imports (else eager ops, the reason noted),
        except for an inference forward run without a CUDA graph: called from Python, each region
        is then one more dispatch of the ``run_region`` op from Inductor's code, while eager glue
        calls the plans directly, and eager glue was the faster (measurements: docs/decisions.md,
        "``glue_backend="auto"`` runs eager glue for inference without a CUDA graph"); and
        except for an inference graph with nothing for Inductor to compile
        (:func:`~fusion_compiler.passes.glue.inductor_work`: its glue is this package's kernels
        and views), whose CUDA graph holds the same kernels either way (docs/decisions.md, "The
        SE block's tail in the gate's kernel").
        """
        if self.options.glue_backend != "auto":
            return self.options.glue_backend
        if not target.cuda or (not target.training and not self.options.cuda_graph):
            return None
        if not target.training and not inductor_work(gm):
            return None
        reason = inductor_reason()
        if reason:
            self._note(notes, f"glue_backend='auto': ops between regions run eagerly: {reason}")
            return None
        return "inductor"

    def for_lowered(self, gm: fx.GraphModule, notes: list[str], args: Sequence[Any],
                    hoisted: HoistedParameters | None, formats: list[torch.memory_format | None],
                    target: Target) -> tuple[Callable[..., Any], str | None, str | None]:
        """What calls of the lowered ``gm`` go through: its glue compiled by ``glue_backend`` (or
        on the background thread, :meth:`inductor_tier`), in a CUDA graph captured on ``args``;
        with the glue backend (``None``: eager ops) and the CUDA graph mode (``None``: no
        graph). Appends to ``notes`` why a default was not taken."""
        glue_backend = self.glue_backend(gm, target, notes)
        runner_for = functools.partial(with_hoisting_and_formats, hoisted=hoisted,
                                       formats=formats)
        tiered = glue_backend == "inductor" and self.options.tiers_before_lowering(target)
        starts = self.ddp_stages(gm, target)
        if starts:  # training: never tiered
            call = staged(gm, starts, glue_backend)
        else:
            call = (gm if glue_backend is None or tiered
                    else _glue_compiled(gm, glue_backend, target.training))
        runner, graphed = runner_for(call), None
        compiles_here = glue_backend is not None and not tiered
        if compiles_here:  # one compile at a time: after the background ones
            drain()
        if self.options.cuda_graph and target.cuda:
            # the warm-up call compiles (and autotunes) a torch.compile'd glue; the option is
            # process-wide, so it is patched only then, with no background compile running
            with (without_custom_op_alias_check() if compiles_here
                  else contextlib.nullcontext()):
                runner, graphed = self.graphed(runner, call, args, notes,
                                               training=target.training)
        if tiered and graphed is None:  # no graph: eager glue is the faster one uncaptured
            glue_backend = None
        elif tiered:
            runner = self.inductor_tier(runner, gm, runner_for, notes)
        return runner, glue_backend, graphed

    def ddp_stages(self, gm: fx.GraphModule, target: Target) -> list[int]:
        """Where a CUDA-graphed training step compiled inside DistributedDataParallel's forward
        is split (``ddp_overlap``; :func:`~fusion_compiler.runtime.ddp_stages.stage_boundaries`
        for DDP's bucket caps); ``[]``: one pair of graphs."""
        if not (target.training and target.cuda and self.options.cuda_graph
                and self.options.ddp_overlap):
            return []
        caps = ddp_bucket_caps()
        starts = stage_boundaries(gm, caps) if caps is not None else []
        if starts:
            log.info("training step split into %d stages at DistributedDataParallel's bucket "
                     "boundaries (first bucket %d bytes, others %d)", len(starts) + 1, *caps)
        return starts

    def graphed(self, run: Callable[..., Any], module: torch.nn.Module, args: Sequence[Any],
                notes: list[str], training: bool = False
                ) -> tuple[Callable[..., Any], str | None]:
        """``run`` replayed as a CUDA graph (:mod:`.runtime.cuda_graph`; for a training
        specialization forward and backward graphs, :mod:`.runtime.cuda_graph_training`), and
        ``"static"`` or ``"safe"``; or ``(run, None)`` when it cannot be captured (the reason is
        noted). ``module`` is what ``run`` calls (the graph module, or ``torch.compile``'s
        wrapper of it)."""
        from .runtime.cuda_graph import CaptureError, CudaGraphRunner  # noqa: PLC0415
        from .runtime.cuda_graph_training import TrainingGraphRunner  # noqa: PLC0415

        static = self.options.cuda_graph == "static"
        try:
            if training:
                runner = TrainingGraphRunner(run, module, args, list(self.model.parameters()),
                                             list(self.model.buffers()), copy_outputs=not static)
            else:
                params = [t for t in (*self.model.parameters(), *self.model.buffers())
                          if not t.is_inference()]
                runner = CudaGraphRunner(run, args, guard=functools.partial(version_sum, params),
                                         copy_outputs=not static)
        except CaptureError as exc:
            what = "training step" if training else "forward"
            self._note(notes, f"the {what} runs without a CUDA graph: {exc}")
            return run, None
        return runner, "static" if static else "safe"

    def inductor_tier(self, first: Any, gm: fx.GraphModule,
                      runner_for: Callable[[Callable[..., Any]], Callable[..., Any]],
                      notes: list[str]) -> TieredRunner:
        """``first`` (the CUDA-graph runner of ``gm`` with eager glue) until ``gm`` compiled by
        Inductor on the background thread replaces it, in a CUDA graph of its own
        (:mod:`.runtime.tiered`).

        The graph goes to Inductor directly (:func:`inductor_compile`: AOTAutograd traces it,
        each region one ``run_region`` op), not through ``torch.compile``: Dynamo on one thread
        must not run beside Python on another (torch 2.11 keeps some of its per-call state
        process-wide, pytorch/pytorch#196637). It compiles an
        :func:`~fusion_compiler.runtime.tiered.isolated_copy` of ``gm``, which shares tensors with
        the model (in-place updates reach the compiled code) but no module, rewritten by the glue
        pipeline (:func:`fusion_compiler.passes.glue`) on the background thread. The compiled
        graph then runs once on copies of the inputs, on a stream of its own, in the caller's
        grad and inference modes, with the regions not executed
        (:func:`~fusion_compiler.runtime.region_op.dry_run`): Triton's autotuning happens there.
        All of it holds
        :data:`~fusion_compiler.runtime.tiered.COMPILE_LOCK`: a new specialization's compile on
        the calling thread waits for it."""
        from .runtime.region_op import dry_run  # noqa: PLC0415

        example = [a.clone() if isinstance(a, torch.Tensor) else a for a in first.static_inputs]
        private = isolated_copy(gm, opaque=lambda m: isinstance(m, Region))
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
                PassManager(glue(), propagate=False).run(private)
                with in_modes(), torch.no_grad():  # an inference graph (no backward traced)
                    compiled = inductor_compile(private, example)
                stream = torch.cuda.Stream(device)
                stream.wait_event(ready)
                with in_modes(), torch.cuda.stream(stream), dry_run(), \
                        without_custom_op_alias_check():
                    compiled(*example)
                stream.synchronize()
            return compiled

        def finish(compiled: Any) -> Callable[..., Any]:  # on the calling thread
            with in_modes():
                runner, graphed = self.graphed(runner_for(compiled), compiled, example, notes)
            if graphed is None:
                raise RuntimeError("its CUDA graph could not be captured")
            return runner

        def failed(reason: str) -> None:
            self._note(notes, f"Inductor's glue failed to compile; eager glue kept: {reason}")

        return TieredRunner(first, build, finish, failed)
