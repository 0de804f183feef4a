"""What the calls of a lowered specialization go through, put together: its graph with the glue
(the ops between regions) as eager ops or compiled by a ``torch.compile`` backend
(:mod:`.glue_compile`; Inductor by default, at the call after the first when tiered), replayed as
a CUDA graph (:mod:`.graphing`), in tiers (:mod:`.runtime.tiered`). Why each default is what it is
(with the measurements): ``docs/decisions.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten

from .config import CompileOptions, Target
from .glue_compile import glue_backend as choose_glue_backend
from .glue_compile import glue_compiled, inductor_compile, without_custom_op_alias_check
from . import graphing
from .ir.region import Region
from .passes import PassManager, glue
from .passes.post_lowering.hoist import HoistedParameters
from .runtime.background import COMPILE_LOCK, drain, on_calling_thread, warn_once
from .runtime.tensors import inference_graph_modes, output_leaves
from .runtime.tiered import TieredRunner, isolated_copy

__all__ = ["Runners", "memory_format", "with_formats", "note_once"]

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


def with_formats(call: Callable[..., Any],
                 formats: list[torch.memory_format | None]) -> Callable[..., Any]:
    """``call`` with its tensor outputs in the memory formats eager returned (``formats``: one
    per tensor output, in :func:`output_leaves` order, ``None`` where any format goes). An
    output that shares memory with an input (the input itself, a view of it) is left as it is:
    eager returns it so, and its layout follows the caller's tensor (whose format the recorded
    one, taken from a copy of the input, need not be). A copy of an output that requires
    gradients records them, whatever the caller's mode (an output made in a
    ``torch.enable_grad`` block of a call made under ``torch.no_grad``)."""
    if not any(f is not None for f in formats):
        return call

    def run(*inputs: Any) -> Any:
        leaves, spec = output_leaves(call(*inputs))
        flat, read = iter(formats), None
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                continue
            f = next(flat, None)
            if f is None or t.is_contiguous(memory_format=f):
                continue
            if read is None:
                read = {a.untyped_storage().data_ptr() for a in inputs
                        if isinstance(a, torch.Tensor)}
            if t.untyped_storage().data_ptr() not in read:
                # recorded as the output was: a torch.enable_grad block's under a no_grad call
                with torch.set_grad_enabled(torch.is_grad_enabled() or t.requires_grad):
                    leaves[i] = t.contiguous(memory_format=f)
        return tree_unflatten(leaves, spec)
    return run


def note_once(noted: set[str], notes: list[str], reason: str) -> None:
    """Record why a default was not taken in ``notes`` (once: a tier that builds its CUDA graph
    again gives the same reasons again); log it once per ``noted`` (module)."""
    if reason not in notes:
        notes.append(reason)
    if reason not in noted:
        noted.add(reason)
        log.info("%s", reason)


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

    def for_lowered(self, gm: fx.GraphModule, notes: list[str], args: Sequence[Any],
                    hoisted: HoistedParameters | None, formats: list[torch.memory_format | None],
                    target: Target) -> tuple[Callable[..., Any], str | None, str | None]:
        """What calls of the lowered ``gm`` go through: its glue compiled by ``glue_backend`` (or
        on the background thread, :meth:`inductor_tier`), in a CUDA graph captured on ``args``;
        with the glue backend (``None``: eager ops) and the CUDA graph mode (``None``: no
        graph). Appends to ``notes`` why a default was not taken."""
        glue_backend, why = choose_glue_backend(self.options, gm, target)
        if why:
            self._note(notes, why)
        plain = functools.partial(with_formats, formats=formats)
        tiered = glue_backend == "inductor" and self.options.tiers_before_lowering(target)
        call = (gm if glue_backend is None or tiered
                else glue_compiled(gm, glue_backend, target.training))
        runner, graphed = graphing.refreshing(plain(call), hoisted), None
        compiles_here = glue_backend is not None and not tiered
        if compiles_here:  # the compile's first call captures: after the background jobs
            drain()
        if self.options.cuda_graph and target.cuda:
            # the warm-up call compiles (and autotunes) a torch.compile'd glue; the option is
            # process-wide, so it is patched only then, with no background compile running
            with (without_custom_op_alias_check() if compiles_here
                  else contextlib.nullcontext()):
                runner, graphed = self.graphed(plain(call), call, args, notes,
                                               training=target.training,
                                               inference=target.inference, gm=gm,
                                               hoisted=hoisted,
                                               caller_grad=target.grad_enabled)
        if tiered and graphed is None:  # no graph: eager glue is the faster one uncaptured
            glue_backend = None
        elif tiered:
            runner = self.inductor_tier(runner, gm, plain, notes, hoisted, target.inference)
        return runner, glue_backend, graphed

    def graphed(self, run: Callable[..., Any], module: torch.nn.Module, args: Sequence[Any],
                notes: list[str], training: bool = False, inference: bool = False,
                gm: fx.GraphModule | None = None, hoisted: HoistedParameters | None = None,
                warn: bool = True, caller_grad: bool = True
                ) -> tuple[Callable[..., Any], str | None]:
        """:func:`~fusion_compiler.graphing.graphed` for this model and options."""
        return graphing.graphed(run, module, args, notes, model=self.model, options=self.options,
                                note=self._note, training=training, inference=inference, gm=gm,
                                hoisted=hoisted, warn=warn, caller_grad=caller_grad)

    def inductor_tier(self, first: Any, gm: fx.GraphModule,
                      plain: Callable[[Callable[..., Any]], Callable[..., Any]],
                      notes: list[str], hoisted: HoistedParameters | None,
                      inference: bool = False) -> TieredRunner:
        """``first`` (the CUDA-graph runner of ``gm`` with eager glue) until ``gm`` compiled by
        Inductor replaces it, in a CUDA graph of its own (:mod:`.runtime.tiered`). The compile
        traces (AOTAutograd's ``make_fx``) and patches functorch's configuration, process-global
        state: it runs on the calling thread, at the call after ``first``'s first (the rule of
        :mod:`.runtime.background`).

        The graph goes to Inductor directly (:func:`inductor_compile`: AOTAutograd traces it,
        each region one ``run_region`` op), not through ``torch.compile``: no Dynamo guards at
        each call. It compiles an :func:`~fusion_compiler.runtime.tiered.isolated_copy` of
        ``gm``, which shares tensors with the model (in-place updates reach the compiled code)
        but no module, rewritten by the glue pipeline (:func:`fusion_compiler.passes.glue`),
        gradients off and inside ``torch.inference_mode()`` with ``inference`` (the
        specialization's mode, whatever the mode of the call that switches). The CUDA graph's
        warm-up runs it first (Triton's autotuning happens there), with AOTAutograd's check of
        custom ops' aliasing off (:func:`without_custom_op_alias_check`)."""
        example = [a.clone() if isinstance(a, torch.Tensor) else a for a in first.static_inputs]
        private = isolated_copy(gm, opaque=lambda m: isinstance(m, Region))

        def finish(_: Any) -> Callable[..., Any]:  # on the calling thread
            on_calling_thread("Inductor's compile of the glue")
            with COMPILE_LOCK:
                PassManager(glue(), propagate=False).run(private)
                with inference_graph_modes(inference):
                    compiled = inductor_compile(private, example)
                with inference_graph_modes(inference), without_custom_op_alias_check():
                    runner, graphed = self.graphed(plain(compiled), compiled, example, notes,
                                                   inference=inference, gm=gm, hoisted=hoisted,
                                                   warn=False)  # failed() says it, once
            if graphed is None:  # the calls stay on the tier before, with its graph
                raise RuntimeError(f"its CUDA graph could not be captured ({notes[-1]})")
            return runner

        def failed(reason: str) -> None:
            warn_once(f"Inductor's compile of {type(self.model).__name__}'s glue", reason)
            self._note(notes, f"Inductor's glue failed to compile; eager glue kept: {reason}")

        return TieredRunner(first, None, finish, failed)
