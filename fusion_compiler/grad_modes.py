"""Gradient modes in a traced graph: which calls run in a mode the code sets itself (a
``torch.no_grad`` or ``torch.enable_grad`` block, a decorated method) and which in the caller's,
written into the graph as ``torch._C._set_grad_enabled`` calls, as Dynamo writes them
(:func:`mark_grad_modes`). The tracer records the mode each call was traced in
(``meta["traced_grad"]``, :class:`~fusion_compiler.tracing.ModeRecordingTracer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from .ir.ops import enables_grad, grad_mode_at_end

__all__ = ["forced_grad_modes", "mark_grad_modes", "records_gradients", "GradFacts",
           "GradFactsByFlags", "dynamo_grad_modes"]


def dynamo_grad_modes(gm: fx.GraphModule) -> None:
    """A Dynamo graph's grad modes, made the ones this package's passes and runners know
    (``torch._C._set_grad_enabled`` calls with constant modes): a ``torch.inference_mode()``
    block, which Dynamo writes as ``_enter_inference_mode(True)`` ... ``_exit_inference_mode``,
    becomes a ``torch.no_grad()`` block (its ops record no gradients, as eager's; kept as calls
    of their own, the block's ops recorded gradients in training, and its parameters got
    gradients eager gives them none: helper-55), returning to the mode before it, and the mode
    the graph leaves is ``gm.meta["grad_mode_left"]`` (set by the compiled call after each call:
    a bare ``torch.set_grad_enabled(False)``). The mode before the graph is the caller's now:
    Dynamo guards on it, and the graph is captured at its first call."""
    g, mode, saved = gm.graph, torch.is_grad_enabled(), {}
    grad_mode = torch.autograd.grad_mode
    for node in list(g.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled and isinstance(node.args[0], bool):
            mode = node.args[0]
        elif node.target is grad_mode._enter_inference_mode and node.args[:1] == (True,):
            saved[node], mode = mode, False
            with g.inserting_before(node):
                g.call_function(torch._C._set_grad_enabled, (False,))
        elif node.target is grad_mode._exit_inference_mode and node.args[0] in saved:
            mode = saved[node.args[0]]
            with g.inserting_before(node):
                g.call_function(torch._C._set_grad_enabled, (mode,))
            g.erase_node(node)
    for node in saved:
        g.erase_node(node)
    if saved:
        gm.recompile()
    gm.meta["grad_mode_left"] = grad_mode_at_end(g)


def forced_grad_modes(graph: fx.Graph, other: fx.Graph, traced_with: bool) -> None:
    """Mark in ``meta["grad_forced"]`` the calls of ``graph`` (traced with gradients on where
    ``traced_with``) whose gradient mode the code sets itself, whatever the caller's (``True``
    in a ``torch.enable_grad`` block, ``False`` in a ``torch.no_grad`` one; ``None``: the
    caller's mode), from ``other``, the same code traced in the other mode: a call traced in the
    same mode both times has its mode set by the code. One trace cannot tell: with gradients on,
    an ``enable_grad`` block looks like the code around it, and was lost when the caller ran
    without gradients. Where the two traces differ (code that reads the mode: its
    specializations are per mode, traced in the caller's), a call traced in another mode than
    ``traced_with`` is marked with it, the others ``None``."""
    calls, others = ([n for n in g.nodes if n.op in _CALLS] for g in (graph, other))
    aligned = len(calls) == len(others) and all((a.op, a.target) == (b.op, b.target)
                                                for a, b in zip(calls, others))
    for k, node in enumerate(calls):
        mode = node.meta.get("traced_grad", True)
        same = others[k].meta.get("traced_grad", True) == mode if aligned else mode != traced_with
        node.meta["grad_forced"] = mode if same else None


_CALLS = ("call_function", "call_method", "call_module")


def records_gradients(graph: fx.Graph) -> bool:
    """Whether a call of ``graph``, traced without gradients, was traced with them on (a
    ``torch.enable_grad`` block: ``meta["traced_grad"]``)."""
    return any(n.meta.get("traced_grad") for n in graph.nodes if n.op in _CALLS)


def mark_grad_modes(gm: fx.GraphModule) -> None:
    """Write into ``gm`` the gradient modes its calls were traced in, as Dynamo writes them:
    ``gm.meta["grad"] = False`` (and ``gm.meta["inference"]``) where every call runs without
    gradients (a ``@torch.no_grad()`` forward); else ``torch._C._set_grad_enabled`` calls where
    the mode changes: to the mode a block sets (:func:`forced_grad_modes`; without that mark,
    ``False`` for a call traced without gradients) and back to the caller's mode (read once,
    before the first change) after it."""
    calls = [n for n in gm.graph.nodes if n.op in _CALLS]

    def wanted(node: fx.Node) -> bool | None:
        if "grad_forced" in node.meta:
            return node.meta["grad_forced"]
        return None if node.meta.get("traced_grad", True) else False

    modes = [wanted(n) for n in calls]
    if calls and all(mode is False for mode in modes):
        gm.meta["grad"] = False
        gm.meta["inference"] = all(n.meta.get("traced_inference", False) for n in calls)
        return
    if all(mode is None for mode in modes):
        return
    graph, current, caller = gm.graph, None, None
    for node, mode in zip(calls, modes):
        if mode != current:
            with graph.inserting_before(node):
                if caller is None:
                    caller = graph.call_function(torch.is_grad_enabled)
                graph.call_function(torch._C._set_grad_enabled,
                                    (caller if mode is None else mode,))
            current = mode
    if current is not None:
        with graph.inserting_before(graph.find_nodes(op="output")[0]):
            graph.call_function(torch._C._set_grad_enabled, (caller,))
    gm.recompile()


@dataclass(frozen=True)
class GradFacts:
    """What a trace of ``forward`` says of gradient modes, read from the captured graph
    (:func:`~fusion_compiler.capture.capture`).

    Attributes:
        grad: some op records gradients (``False``: every op runs without, as under a
            ``@torch.no_grad()`` decorator or a block around the whole forward).
        inference: every op runs in inference mode.
        reads: ``forward`` reads ``torch.is_grad_enabled()``.
        enables: ops record gradients in a call made without them (a ``torch.enable_grad``
            block).
    """

    grad: bool
    inference: bool
    reads: bool
    enables: bool

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "GradFacts":
        return cls(gm.meta.get("grad", True), gm.meta.get("inference", False),
                   gm.meta.get("grad_mode_read", False),
                   enables_grad(gm.graph) or gm.meta.get("grad_mode_raised", False))


class GradFactsByFlags:
    """:class:`GradFacts` for each combination of the model's ``training`` flags, from a trace
    made with them (``trace()``, the model as it is now): ``forward``'s Python may choose its
    modes from them (``with torch.set_grad_enabled(self.training):``), and a trace in eval mode
    says nothing of a call in training mode (its specialization was captured without
    gradients). :meth:`clear` when the model changed."""

    def __init__(self, trace: Callable[[], fx.GraphModule]):
        self._trace = trace
        self._known: dict[tuple, GradFacts] = {}

    def seed(self, flags: tuple, gm: fx.GraphModule) -> None:
        """Take ``gm``, traced with ``flags``, as the trace for them."""
        self._known[flags] = GradFacts.of(gm)

    def __call__(self, flags: tuple) -> GradFacts:
        facts = self._known.get(flags)
        if facts is None:
            facts = self._known[flags] = GradFacts.of(self._trace())
        return facts

    def clear(self) -> None:
        self._known.clear()
