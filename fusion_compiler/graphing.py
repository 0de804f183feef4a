"""Graphing: a lowered specialization's calls replayed as CUDA graphs (:func:`graphed`: the
inference runner with its derivation prologue, or the training runner's forward and backward
pair), and the plain runner that keeps hoisted parameter work current when there is no graph
(:func:`refreshing`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .config import CompileOptions
from .ir.ops import registers_tensor_hook, writes_in_place, written_inputs
from .ir.region import Region
from .passes.post_lowering.hoist import HoistedParameters, returned
from .shapes import written_state

__all__ = ["graphed", "refreshing"]


def refreshing(run: Callable[..., Any], hoisted: HoistedParameters | None) -> Callable[..., Any]:
    """``run`` after recomputing ``hoisted`` (parameter subgraphs computed apart from the graph):
    how a graph that is not replayed from a CUDA graph keeps them current."""
    if hoisted is None:
        return run

    def refreshed(*inputs: Any) -> Any:
        hoisted.refresh()
        return run(*inputs)
    return refreshed


def _not_capturable(args: Sequence[Any], written: list[int], training: bool) -> str:
    """Why a graph of these inputs cannot be replayed from a CUDA graph (``""``: it can): a CPU
    tensor among them (a Python float Dynamo passes as a 0-d tensor; a graph would replay the
    value it was captured with), or, in training, an input the graph writes in place."""
    if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args):
        return "an input is a CPU tensor (a replay would repeat the value captured)"
    if training and written:
        return "the step writes into an input in place"
    return ""


def _registers_hooks(gm: fx.GraphModule | None) -> bool:
    """Whether ``gm`` registers a tensor hook (Dynamo's ``higher_order.register_hook``, or the
    method): autograd calls it in the backward, which a CUDA graph replays without Python."""
    return gm is not None and any(registers_tensor_hook(n.op, n.target) for n in gm.graph.nodes)


def _cpu_results(gm: fx.GraphModule | None) -> str:
    """The first op of ``gm`` that makes or writes a CPU tensor the caller sees: an output, or
    a write in place (into a CPU buffer, say). A capture records GPU work only: the CPU op ran
    once, at capture (``return y, torch.ones(2) * 2``, a model whose GPU forward keeps a CPU
    counter). CPU values that only feed GPU work (sizes, constants) are the same at every
    replay and do not count."""
    if gm is None:
        return ""
    seen = {n for n in returned(gm.graph) if n.op != "get_attr"}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op in ("placeholder", "get_attr", "output") or not isinstance(
                value, torch.Tensor) or not (node in seen or writes_in_place(node)):
            continue
        device = node.meta.get("device", value.device)
        if device.type == "cpu":
            return node.name
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


def graphed(run: Callable[..., Any], module: torch.nn.Module, args: Sequence[Any],
            notes: list[str], *, model: torch.nn.Module, options: CompileOptions,
            note: Callable[[list[str], str], None], training: bool = False,
            inference: bool = False, gm: fx.GraphModule | None = None,
            hoisted: HoistedParameters | None = None, warn: bool = True,
            caller_grad: bool = True) -> tuple[Callable[..., Any], str | None]:
    """``run`` replayed as a CUDA graph (:mod:`.runtime.cuda_graph`; for a training specialization
    forward and backward graphs, :mod:`.runtime.cuda_graph_training`), and ``"safe"`` (outputs never
    overwritten by a later call); or ``run`` (after refreshing ``hoisted`` at each call) and
    ``None`` when it cannot be captured (the reason is noted with ``note``; a capture that failed,
    an unexpected and slower fallback, is one WARNING too, unless not ``warn``: a caller that
    says it itself). ``module`` is what ``run`` calls (the graph module, or ``torch.compile``'s
    wrapper of it); an inference graph
    starts with the derivation prologue of the model's state, ``gm``'s tensors and ``hoisted``
    (:mod:`.runtime.derivations`) and is captured inside ``torch.inference_mode()`` with
    ``inference`` (the specialization's mode, whatever the mode of the call that switches tiers).
    The inference graphs of one ``model`` are captured on a stream of its own
    (:func:`.runtime.replays.capture_stream`): those of two models may replay at once. A
    training step called without gradients (``not caller_grad``: a ``torch.enable_grad`` block
    in forward records them) is not captured: the replayed step would record none."""
    from .runtime.background import warn_once  # noqa: PLC0415
    from .runtime.cuda_graph import CaptureError, CudaGraphRunner  # noqa: PLC0415
    from .runtime.cuda_graph_training import TrainingGraphRunner  # noqa: PLC0415
    from .runtime.derivations import Derivations  # noqa: PLC0415

    written = written_inputs(gm) if gm is not None else []
    what = "training step" if training else "forward"
    why, cpu = _not_capturable(args, written, training), _cpu_results(gm)
    if not why and training and _registers_hooks(gm):
        why = ("it registers a tensor hook (y.register_hook): a replayed backward would not "
               "call it")
    if not why and training and not caller_grad:
        why = ("it is called without gradients and turns them on in a block (torch."
               "enable_grad): a replayed step would record none")
    if cpu and not why:  # unexpected, and slower: one WARNING too
        why = (f"it computes on the CPU a tensor it returns or writes in place ({cpu}): a "
               "replay runs the GPU's work only, and would repeat what the capture computed")
        if warn:
            warn_once(f"capturing the {what} in a CUDA graph", f"{why}; the {what} runs "
                      "without a CUDA graph")
    if why:
        note(notes, f"the {what} runs without a CUDA graph: {why}")
        return refreshing(run, hoisted), None
    try:
        if training:
            runner = TrainingGraphRunner(run, module, args, list(model.parameters()),
                                         list(model.buffers()))
        else:
            state = [*model.parameters(), *model.buffers(),
                     *(gm.parameters() if gm is not None else ()),
                     *(gm.buffers() if gm is not None else ())]
            derivations = Derivations(state, hoisted, _read_beside_regions(gm, hoisted),
                                      frozen=options.freezing)
            writable = [*model.buffers(), *(written_state(gm) if gm is not None else ())]
            runner = CudaGraphRunner(run, args, derivations=derivations, buffers=writable,
                                     written=written, inference=inference,
                                     model=model, state=state)
            for text in runner.derivations.notes:
                note(notes, text)
    except CaptureError as exc:  # unexpected, and slower: one WARNING (the report keeps it)
        notes.append(f"the {what} runs without a CUDA graph: {exc}")
        if warn:
            warn_once(f"capturing the {what} in a CUDA graph",
                      f"{exc}; the {what} runs without a CUDA graph")
        return refreshing(run, hoisted), None
    return runner, "safe"
