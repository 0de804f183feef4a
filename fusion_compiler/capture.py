"""Capture: an ``nn.Module`` becomes a ``torch.fx.GraphModule`` (:func:`capture`), and a call's
inputs become the key of a specialization (:func:`input_specs`). The tensor metadata of the
graph's nodes is filled in afterwards, by :mod:`fusion_compiler.shapes`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import types
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from .code_reads import globals_read
from .ir.errors import FusionError, InputTypeError
from .ir.ops import copy_graph
from .random_ops import random_state
from .runtime.background import on_calling_thread, warn_once
from .runtime.hooks import instance_forward, uninitialized_lazy
from .runtime.module_writes import ModuleWrites
from .runtime.state import first_time, note_reads
from .dynamo_capture import dynamo_graph
from .grad_modes import forced_grad_modes, mark_grad_modes, records_gradients
from .output_types import skeleton
from .parametrized_calls import parametrized_calls, uncached
from .tensor_reads import values_read
from .trace_constants import constants_written, fresh_constant_outputs
from .tracing import ModeRecordingTracer, recording_reads

log = logging.getLogger("fusion_compiler")
_TOLD: weakref.WeakSet = weakref.WeakSet()  # models told what their forward reads once

__all__ = ["TensorSpec", "capture", "input_specs", "unpacked_inputs", "flatten_inputs",
           "unpack_inputs", "untrainable"]


@dataclass(frozen=True)
class TensorSpec:
    """What a compiled graph is specialized on, for one tensor input.

    ``shape`` and ``stride`` are in elements, ``device`` is e.g. ``"cuda:0"``.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        return f"{dims}:{str(self.dtype).removeprefix('torch.')}@{self.device}"


def input_specs(args: Sequence[Any]) -> tuple:
    """The specialization key of a call: a :class:`TensorSpec` per tensor, the value otherwise (a
    tuple of tensors that :func:`flatten_inputs` left whole by itself: each new tuple compiles
    again, with one WARNING).

    Raises:
        InputTypeError: a list, dict or set input (it may change between calls unseen), or any
            other that cannot be hashed (a ``types.SimpleNamespace``: no key can hold it)."""
    for i, a in enumerate(args):
        if isinstance(a, (list, dict, set)):
            raise InputTypeError(f"input {i} is a {type(a).__name__}: compiled graphs take "
                                 "tensors, numbers and tuples (pass the tensors as arguments)")
        if not isinstance(a, torch.Tensor) and getattr(type(a), "__hash__", None) is None:
            raise InputTypeError(f"input {i} is a {type(a).__name__}, which cannot be hashed: "
                                 "compiled graphs take tensors, numbers, tuples and hashable "
                                 "objects (pass the tensors as arguments)")
        if isinstance(a, tuple) and any(isinstance(t, torch.Tensor) for t in a):
            warn_once("reusing a specialization", f"input {i}, a tuple of tensors that forward "
                      "does not only unpack (or index), is keyed by the tuple itself: each new "
                      "tuple compiles again (pass its tensors as arguments)")
    return tuple(TensorSpec.of(a) if isinstance(a, torch.Tensor) else a for a in args)


def unpacked_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of ``gm``'s inputs that the graph only indexes with constant integers
    (``a, b = pair``, ``pair[0]``): a tuple passed there can be taken apart at the call
    (:func:`flatten_inputs`, :func:`unpack_inputs`)."""
    return frozenset(i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder"))
                     if ph.users and all(u.op == "call_function" and u.target is operator.getitem
                                         and isinstance(u.args[1], int) and not u.kwargs
                                         for u in ph.users))


def flatten_inputs(args: Sequence[Any], unpacked: frozenset[int]) -> tuple[tuple, tuple]:
    """A call's inputs as the graph :func:`unpack_inputs` made takes them, and their structure:
    each tuple at a position of ``unpacked`` (:func:`unpacked_inputs`) replaced by its items
    (tensors, numbers), nested tuples kept whole. The structure holds, per input, the tuple's
    length, or ``None`` for an input passed as it is; it is part of the specialization key."""
    if not unpacked or not any(isinstance(a, tuple) for a in args):
        return tuple(args), ()
    flat: list[Any] = []
    structure = []
    for i, a in enumerate(args):
        if i in unpacked and isinstance(a, tuple):
            flat.extend(a)
            structure.append(len(a))
        else:
            flat.append(a)
            structure.append(None)
    return tuple(flat), tuple(structure)


def unpack_inputs(gm: fx.GraphModule, structure: Sequence[int | None]) -> fx.GraphModule:
    """Rewrite ``gm`` (captured; its inputs at the tuple positions of ``structure`` only indexed,
    :func:`unpacked_inputs`) to take each tuple's items as inputs of their own, in order: the
    graph of :func:`flatten_inputs`' inputs. An index out of the tuple's range raises
    ``IndexError`` as Python would."""
    graph = gm.graph
    for ph, length in zip(list(graph.find_nodes(op="placeholder")), structure):
        if length is None:
            continue
        with graph.inserting_after(ph):
            items: list[fx.Node] = []
            for k in range(length):
                with graph.inserting_after(items[-1] if items else ph):
                    items.append(graph.placeholder(f"{ph.target}_{k}"))
        for use in list(ph.users):
            use.replace_all_uses_with(items[use.args[1]])
            graph.erase_node(use)
        graph.erase_node(ph)
    gm.recompile()
    return gm


def capture(model: torch.nn.Module, none: Sequence[str] = (), grad_enabled: bool = True,
            tensors: Mapping[str, int] | None = None) -> fx.GraphModule:
    """Trace ``model`` with ``torch.fx``; a ``GraphModule`` (a Dynamo graph) is not traced again
    but copied: a graph module of its own, with a copy of its graph and the same submodules and
    tensors, so that the passes, which rewrite the graph they get in place, leave the model's
    graph as it was (each specialization starts from it).

    ``none``: names of ``forward``'s arguments traced as ``None`` (a call that passes ``None``
    for an optional input: ``if mask is not None`` takes the branch eager takes). Gradient mode
    is recorded as eager runs the code: a forward that turns gradients off everywhere (a
    ``@torch.no_grad()`` or ``@torch.inference_mode()`` forward) sets ``gm.meta["grad"]`` to
    ``False`` (``gm.meta["inference"]`` too for inference mode); one that turns them off for part
    of its code gets ``torch._C._set_grad_enabled`` calls where the mode changes, as Dynamo
    writes them. ``gm.meta["autograd_functions"]`` names the ``torch.autograd.Function``
    classes ``forward`` applies (fx traced their ``forward``; their ``backward`` is lost);
    ``gm.meta["checkpoints"]`` counts the non-reentrant ``torch.utils.checkpoint`` calls traced
    through (their activations are kept, not recomputed). A forward that reads
    ``torch.is_grad_enabled()`` sets ``gm.meta["grad_mode_read"]`` and is traced with that
    answer being ``grad_enabled`` (the caller's grad mode: a specialization's key holds it).
    ``tensors``: ``forward``'s arguments that are tensors in the call traced for, by name, with
    their number of dimensions (``isinstance(x, torch.Tensor)`` asked by the model's code holds
    for them in the trace, as in eager, and ``x.dim()`` is a number).

    Raises:
        FusionError: the model's ``forward`` is not symbolically traceable (data-dependent
            control flow, for instance; the message carries fx's own error), or assigns to
            the model (``self.count += 1``; the model is left as it was), or enters a
            ``torch.autocast`` block, or has a ``forward`` replaced on the instance (fx traces
            the class's), or holds a lazy module that has not made its parameters yet, or
            leaves the gradient mode changed to one that depends on the caller's (one
            mode left whatever the caller's is ``gm.meta["grad_mode_left"]``). A
            ``DistributedDataParallel`` module gets a message naming the fix.
    """
    if isinstance(model, fx.GraphModule):  # (Dynamo's: the modes it sets are constants)
        return dynamo_graph(fx.GraphModule(model, copy_graph(model.graph)))
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise FusionError(
            "fusion_compiler.compile got a DistributedDataParallel module: compile the model "
            "inside it and wrap the result, DDP(fusion_compiler.compile(model)), so DDP still "
            "all-reduces the gradients (or use torch.compile(DDP(model), "
            "backend='fusion_compiler'))")
    lazy = uninitialized_lazy(model)
    if lazy:
        raise FusionError(lazy)
    replaced = instance_forward(model)
    if replaced is not None:  # fx traces type(model).forward, not what __call__ runs
        raise FusionError(
            f"{type(model).__name__}.forward was replaced on the instance "
            f"({_short_name(replaced)}), and compile(model) traces the class's "
            "forward: define it in a subclass, or use torch.compile(model, "
            "backend='fusion_compiler'), which follows it (one replaced on a submodule is "
            "traced through)")
    on_calling_thread("torch.fx tracing")
    global_names, stored, once = globals_read(
        m for m in dict.fromkeys(model.modules()) if not type(m).__module__.startswith("torch."))
    draws = {n: value for n, (kind, _, value) in once.items() if kind == "random"}
    drawn_from = {n: random_state(value) for n, value in draws.items()}
    state = list(dict.fromkeys(what for kind, what, _ in once.values() if kind == "state"))
    if state and first_time(_TOLD, model):  # once per model: each specialization traces again
        log.warning(
            "%s's forward reads %s: a compiled graph keeps what its trace read, so a change "
            "after this compile is not seen; call the model uncompiled where it must follow "
            "one", type(model).__name__, ", ".join(state))
    iterators = [n for n, (kind, _, _) in once.items() if kind == "iterator"]
    if iterators:  # (before the trace: it would take an item)
        raise FusionError(
            f"{type(model).__name__}'s forward reads {', '.join(iterators)}, an iterator at "
            "module level: a traced graph would keep the one item its trace took, for every "
            "call; pass the value in, or call the model uncompiled")
    if stored:  # the trace would assign it once, the compiled calls never
        raise FusionError(
            f"{type(model).__name__}'s forward assigns the module-level name(s) "
            f"{', '.join(stored)} (a global statement): a compiled graph cannot repeat the "
            "assignment at each call; keep that state outside forward (or on the module as a "
            "buffer), or call the model uncompiled")

    def trace(grad: bool) -> tuple[ModeRecordingTracer, fx.Graph, dict]:
        tracer = ModeRecordingTracer()
        tracer.tensor_inputs = dict(tensors or {})
        with torch.set_grad_enabled(grad), recording_reads(model) as reads, uncached(), \
                values_read(model) as values:
            graph = tracer.trace(model, concrete_args={name: None for name in none} or None)
            ends[grad] = torch.is_grad_enabled()  # (torch.set_grad_enabled(False), bare)
        read_as_values.extend(values)
        return tracer, graph, reads

    read_as_values: list[tuple[dict, str]] = []  # plain tensor attributes: self.k.item()

    ends: dict[bool, bool] = {}  # the grad mode each trace ended in, by the one it began in

    # the trace runs forward's Python code: the model, and what it changes at module level
    # (COUNTER[0] += 1, a global config's field), are put back
    writes = ModuleWrites(model, _module_level(global_names))
    try:
        tracer, graph, reads = trace(True)
        traced_with = True
        # an alias of torch.is_grad_enabled is not the tracer's: its reads are seen statically
        tracer.grad_mode_read |= any(kind == "grad" for kind, _, _ in once.values())
        if tracer.grad_mode_read and not grad_enabled:  # the branch the caller's mode takes
            writes.restore()
            tracer, graph, reads = trace(False)
            tracer.grad_mode_read, traced_with = True, False
        without = graph  # (the trace begun without gradients, where one was made)
        if tracer.grad_mode_set:  # a no_grad or enable_grad block: which calls it holds
            writes.restore()
            other = trace(not traced_with)[1]
            forced_grad_modes(graph, other, traced_with)
            without = graph if not traced_with else other
        # ops that record gradients in a call made without them (an enable_grad block)
        raised = tracer.grad_mode_set and records_gradients(without)
        note_reads(reads, model, global_names, read_as_values)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        parametrized_calls(gm)  # (before anything runs the graph)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        writes.restore()
        detail = str(exc)
        star = _variadic(model)
        if star and "iterated" in detail:  # fx's own text speaks of loops and proxies
            detail = (f"forward takes {star}, and fx traces a fixed list of inputs: name them, "
                      f"forward(self, x, y) (fx: {detail.split('. ')[0]})")
        replaced = [path for path, m in model.named_modules() if instance_forward(m) is not None]
        if replaced:  # traced through instead of kept as fx leaves: say so
            detail += (f" (the forward replaced on the instance of {', '.join(replaced)} is "
                       "traced through, and a torch.nn module's own forward may not trace)")
        raise FusionError(
            f"torch.fx.symbolic_trace failed for {type(model).__name__}: {detail}. "
            "Use torch.compile(model, backend='fusion_compiler') for code fx cannot trace "
            "(data-dependent control flow, item assignment, NumPy values)."
        ) from exc
    assigned = writes.restore()
    left = set(ends.values()) if any(start != end for start, end in ends.items()) else set()
    if len(left) > 1:
        raise FusionError(
            f"{type(model).__name__}.forward leaves the gradient mode changed, to one that "
            "depends on the caller's (torch.set_grad_enabled outside a with statement): a "
            "compiled call cannot repeat that; use 'with torch.no_grad():' in forward")
    if tracer.autocast_entered:
        raise FusionError(
            f"{type(model).__name__}.forward enters torch.autocast: a graph torch.fx traces keeps "
            "no context manager, so the block's ops would run in the caller's autocast state; "
            "use torch.compile(model, backend='fusion_compiler'), whose graphs keep it")
    if assigned:
        raise FusionError(
            f"{type(model).__name__}.forward changes {', '.join(assigned)} (on the module, an "
            "object it holds or at module level): a compiled graph cannot repeat that at each "
            "call (an in-place update of a buffer it can: self.n.add_(1)); move it out of "
            "forward, or use torch.compile(model, backend='fusion_compiler'), whose graphs "
            "Dynamo guards")
    drawn = [n for n, value in draws.items()
             if drawn_from[n] is None or random_state(value) != drawn_from[n]]
    if drawn:  # the trace drew (a draw in a branch it did not take is no draw)
        raise FusionError(
            f"{type(model).__name__}'s forward draws random numbers with Python's or NumPy's "
            f"generator ({', '.join(drawn)}): a traced graph would repeat the trace's numbers at "
            "every call; draw them with torch (torch.rand), which a compiled graph draws afresh "
            "at each call, or pass them in, or call the model uncompiled")
    written = constants_written(gm)
    if written:
        raise FusionError(
            f"{type(model).__name__}'s forward writes in place into a tensor it makes from "
            f"constant arguments ({', '.join(written)}): the trace made that tensor once, so a "
            "compiled graph would write into the same one at every call (the writes would add "
            "up); write it out of place (w = torch.ones(4) * s, torch.where(...)), or call the "
            "model uncompiled")
    fresh_constant_outputs(gm)
    mark_grad_modes(gm)
    gm.meta["autograd_functions"] = sorted(set(tracer.autograd_functions))
    gm.meta["checkpoints"] = tracer.checkpoints
    gm.meta["grad_mode_read"] = tracer.grad_mode_read
    gm.meta["grad_mode_raised"] = raised
    gm.meta["grad_mode_left"] = left.pop() if left else None  # set by the compiled call too
    gm.meta["output_types"] = skeleton(tracer.last_output)  # (put back by the compiled call)
    return gm


def _variadic(model: torch.nn.Module) -> str:
    """``"*xs"`` or ``"**kw"`` where ``model.forward`` takes a variable number of arguments
    (``""`` otherwise)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ""
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(marks[p.kind] + p.name for p in params if p.kind in marks)


_CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
         type, functools.partial)


def _module_level(names: Sequence[tuple[Any, str]]) -> list[tuple[str, Any]]:
    """``(name shown, value)`` of the module-level names ``forward``'s code reads
    (:func:`~.code_reads.globals_read`: a globals dict or a class, and the name) that hold data
    a trace could change: not modules, classes or functions."""
    found = []
    for namespace, name in names:
        if isinstance(namespace, types.CellType):  # a closure's: guarded, not put back
            continue
        value = namespace.get(name) if isinstance(namespace, dict) else vars(namespace).get(name)
        if value is not None and not isinstance(value, _CODE):  # (an object with __call__ is)
            found.append((f"module-level {name}", value))
    return found


def untrainable(gm: fx.GraphModule, name: str) -> str | None:
    """Why calls of ``gm`` (captured from model class ``name``) that record gradients cannot be
    compiled, or ``None``: ``forward`` applies a ``torch.autograd.Function``, whose backward
    the traced graph does not hold (:func:`capture`)."""
    functions = gm.meta.get("autograd_functions")
    if not functions:
        return None
    hint = (" (torch.utils.checkpoint with use_reentrant=False compiles)"
            if "CheckpointFunction" in functions else "")
    return (f"{name}.forward applies torch.autograd.Function {', '.join(functions)}, whose "
            f"backward a traced graph does not keep{hint}")


def _short_name(value: Any) -> str:
    """A callable's qualified name, for a message."""
    inner = getattr(value, "__func__", None) or getattr(value, "func", None) or value
    return getattr(inner, "__qualname__", type(value).__name__)
