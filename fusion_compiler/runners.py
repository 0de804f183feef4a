"""What the calls of a lowered specialization go through: its graph with the glue (the ops between
regions) as eager ops or compiled by a ``torch.compile`` backend (Inductor by default, on the
background thread when tiered), replayed as a CUDA graph. Why each default is what it is (with the
measurements): ``docs/decisions.md``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from .config import CompileOptions, Target
from .ir.ops import written_inputs
from .ir.region import Region
from .kernels import triton_import_error
from .passes import PassManager, glue
from .passes.glue import inductor_work
from .passes.post_lowering.hoist import HoistedParameters
from .runtime.background import COMPILE_LOCK, drain, on_calling_thread, warn_once
from .runtime.tiered import TieredRunner, isolated_copy

__all__ = ["Runners", "memory_format", "with_formats", "refreshing", "inductor_reason",
           "inductor_compile", "inductor_without_autograd_cache", "without_custom_op_alias_check"]


def memory_format(t: Any) -> torch.memory_format | None:
    """The memory format eager returned for an output (``None``: leave it as it comes)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return None
    if t.is_contiguous():
        return torch.contiguous_format
    if t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def with_formats(call: Callable[..., Any],
                 formats: list[torch.memory_format | None]) -> Callable[..., Any]:
    """``call`` with its outputs in the memory formats eager returned (``formats``: one per
    output, ``None`` where any format goes)."""
    if not any(f is not None for f in formats):
        return call

    def run(*inputs: Any) -> Any:
        out = call(*inputs)
        flat = iter(formats)
        return tree_map(lambda t: t.contiguous(memory_format=f)
                        if (f := next(flat)) is not None
                        and not t.is_contiguous(memory_format=f) else t, out)
    return run


def refreshing(run: Callable[..., Any], hoisted: HoistedParameters | None) -> Callable[..., Any]:
    """``run`` after recomputing ``hoisted`` (parameter subgraphs computed apart from the graph):
    how a graph that is not replayed from a CUDA graph keeps them current."""
    if hoisted is None:
        return run

    def refreshed(*inputs: Any) -> Any:
        hoisted.refresh()
        return run(*inputs)
    return refreshed


@functools.cache
def inductor_reason() -> str:
    """Why Inductor cannot compile CUDA glue here (``""``: it can): Triton must import and the GPU
    must have compute capability 7.0 or newer (what Inductor's Triton backend needs)."""
    error = triton_import_error()
    if error:
        return f"Triton does not import ({error})"
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
    on_calling_thread("Inductor's compile")
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
    and restores it), so it is patched only on the calling thread (the rule of
    :mod:`fusion_compiler.runtime.background`).
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
    on_calling_thread("torch.compile of the glue")
    backend = (inductor_without_autograd_cache if training and glue_backend == "inductor"
               else glue_backend)
    return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)


def _not_capturable(args: Sequence[Any], written: list[int], training: bool) -> str:
    """Why a graph of these inputs cannot be replayed from a CUDA graph (``""``: it can): a CPU
    tensor among them (a Python float Dynamo passes as a 0-d tensor; a graph would replay the
    value it was captured with), or, in training, an input the graph writes in place."""
    if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args):
        return "an input is a CPU tensor (a replay would repeat the value captured)"
    if training and written:
        return "the step writes into an input in place"
    return ""


def _read_beside_regions(gm: fx.GraphModule | None,
                         hoisted: HoistedParameters | None) -> list[str]:
    """The hoisted values of ``gm`` that an op other than a region reads (a region's kernel says
    when it reads one, :func:`fusion_compiler.runtime.weight_cache.note_reads`; other ops do
    not, so the derivation prologue makes these before the forward)."""
    if gm is None or hoisted is None:
        return []
    names = set(hoisted.names)
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in names
            and any(u.op != "call_module" or not isinstance(gm.get_submodule(u.target), Region)
                    for u in n.users)]


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
        plain = functools.partial(with_formats, formats=formats)
        tiered = glue_backend == "inductor" and self.options.tiers_before_lowering(target)
        call = (gm if glue_backend is None or tiered
                else _glue_compiled(gm, glue_backend, target.training))
        runner, graphed = refreshing(plain(call), hoisted), None
        compiles_here = glue_backend is not None and not tiered
        if compiles_here:  # the compile's first call captures: after the background jobs
            drain()
        if self.options.cuda_graph and target.cuda:
            # the warm-up call compiles (and autotunes) a torch.compile'd glue; the option is
            # process-wide, so it is patched only then, with no background compile running
            with (without_custom_op_alias_check() if compiles_here
                  else contextlib.nullcontext()):
                runner, graphed = self.graphed(plain(call), call, args, notes,
                                               training=target.training, gm=gm,
                                               hoisted=hoisted)
        if tiered and graphed is None:  # no graph: eager glue is the faster one uncaptured
            glue_backend = None
        elif tiered:
            runner = self.inductor_tier(runner, gm, plain, notes, hoisted)
        return runner, glue_backend, graphed

    def graphed(self, run: Callable[..., Any], module: torch.nn.Module, args: Sequence[Any],
                notes: list[str], training: bool = False, gm: fx.GraphModule | None = None,
                hoisted: HoistedParameters | None = None
                ) -> tuple[Callable[..., Any], str | None]:
        """``run`` replayed as a CUDA graph (:mod:`.runtime.cuda_graph`; for a training
        specialization forward and backward graphs, :mod:`.runtime.cuda_graph_training`), and
        ``"static"`` or ``"safe"``; or ``run`` (after refreshing ``hoisted`` at each call) and
        ``None`` when it cannot be captured (the reason is noted). ``module`` is what ``run``
        calls (the graph module, or ``torch.compile``'s wrapper of it); an inference graph
        starts with the derivation prologue of the model's state, ``gm``'s tensors and
        ``hoisted`` (:mod:`.runtime.derivations`)."""
        from .runtime.cuda_graph import CaptureError, CudaGraphRunner  # noqa: PLC0415
        from .runtime.cuda_graph_training import TrainingGraphRunner  # noqa: PLC0415
        from .runtime.derivations import Derivations  # noqa: PLC0415

        static = self.options.cuda_graph == "static"
        written = written_inputs(gm) if gm is not None else []
        why = _not_capturable(args, written, training)
        if why:
            self._note(notes, f"the {'training step' if training else 'forward'} runs without a "
                              f"CUDA graph: {why}")
            return refreshing(run, hoisted), None
        try:
            if training:
                runner = TrainingGraphRunner(run, module, args, list(self.model.parameters()),
                                             list(self.model.buffers()), copy_outputs=not static)
            else:
                state = [*self.model.parameters(), *self.model.buffers(),
                         *(gm.parameters() if gm is not None else ()),
                         *(gm.buffers() if gm is not None else ())]
                derivations = Derivations(state, hoisted, _read_beside_regions(gm, hoisted),
                                          frozen=self.options.freezing)
                runner = CudaGraphRunner(run, args, derivations=derivations,
                                         copy_outputs=not static,
                                         buffers=list(self.model.buffers()), written=written)
                for note in runner.derivations.notes:
                    self._note(notes, note)
        except CaptureError as exc:
            what = "training step" if training else "forward"
            self._note(notes, f"the {what} runs without a CUDA graph: {exc}")
            return refreshing(run, hoisted), None
        return runner, "static" if static else "safe"

    def inductor_tier(self, first: Any, gm: fx.GraphModule,
                      plain: Callable[[Callable[..., Any]], Callable[..., Any]],
                      notes: list[str], hoisted: HoistedParameters | None) -> TieredRunner:
        """``first`` (the CUDA-graph runner of ``gm`` with eager glue) until ``gm`` compiled by
        Inductor replaces it, in a CUDA graph of its own (:mod:`.runtime.tiered`). The compile
        traces (AOTAutograd's ``make_fx``) and patches functorch's configuration, process-global
        state: it runs on the calling thread, at the call after ``first``'s first (the rule of
        :mod:`.runtime.background`).

        The graph goes to Inductor directly (:func:`inductor_compile`: AOTAutograd traces it,
        each region one ``run_region`` op), not through ``torch.compile``: no Dynamo guards at
        each call. It compiles an :func:`~fusion_compiler.runtime.tiered.isolated_copy` of
        ``gm``, which shares tensors with the model (in-place updates reach the compiled code)
        but no module, rewritten by the glue pipeline (:func:`fusion_compiler.passes.glue`), in
        the grad and inference modes of the call that made ``first``. The CUDA graph's warm-up
        runs it first (Triton's autotuning happens there), with AOTAutograd's check of custom
        ops' aliasing off (:func:`without_custom_op_alias_check`)."""
        example = [a.clone() if isinstance(a, torch.Tensor) else a for a in first.static_inputs]
        private = isolated_copy(gm, opaque=lambda m: isinstance(m, Region))
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())

        def in_modes() -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode(modes[0]))
            stack.enter_context(torch.set_grad_enabled(modes[1]))
            return stack

        def finish(_: Any) -> Callable[..., Any]:  # on the calling thread
            on_calling_thread("Inductor's compile of the glue")
            with COMPILE_LOCK:
                PassManager(glue(), propagate=False).run(private)
                with in_modes(), torch.no_grad():  # an inference graph (no backward traced)
                    compiled = inductor_compile(private, example)
                with in_modes(), without_custom_op_alias_check():
                    runner, graphed = self.graphed(plain(compiled), compiled, example, notes,
                                                   gm=gm, hoisted=hoisted)
            if graphed is None:
                raise RuntimeError("its CUDA graph could not be captured")
            return runner

        def failed(reason: str) -> None:
            warn_once(f"Inductor's compile of {type(self.model).__name__}'s glue", reason)
            self._note(notes, f"Inductor's glue failed to compile; eager glue kept: {reason}")

        return TieredRunner(first, None, finish, failed)
