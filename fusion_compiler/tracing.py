"""The ``torch.fx`` tracer of :func:`fusion_compiler.capture.capture`: gradient and inference
modes recorded on every node, buffers traced like parameters, augmented assignments
(``x += y``) traced as the in-place ops they are, and the attributes ``forward`` reads recorded
(:func:`recording_reads`)."""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx

__all__ = ["ModeRecordingTracer", "mark_grad_modes", "recording_reads"]


@contextlib.contextmanager
def recording_reads(model: torch.nn.Module) -> Iterator[dict[torch.nn.Module, set[str]]]:
    """Record the attribute names read on each module of ``model`` whose code the trace runs
    (all but ``torch.nn``'s own, which fx keeps as leaves): each such module's class is swapped,
    for the block, for a subclass whose ``__getattribute__`` notes the name. A module whose
    class cannot be swapped is left out of the mapping."""
    reads: dict[torch.nn.Module, set[str]] = {}
    swapped = []
    for module in dict.fromkeys(model.modules()):
        cls = type(module)
        if cls.__module__.startswith("torch."):
            continue
        names: set[str] = set()

        def __getattribute__(self: Any, name: str, _names: set[str] = names,
                             _cls: type = cls) -> Any:
            _names.add(name)
            return _cls.__getattribute__(self, name)

        recording = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                                "__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__})
        try:
            module.__class__ = recording
        except TypeError:  # a layout the subclass does not share
            continue
        swapped.append((module, cls))
        reads[module] = names
    try:
        yield reads
    finally:
        for module, cls in swapped:
            module.__class__ = cls


class ModeRecordingTracer(fx.Tracer):
    """``torch.fx.Tracer`` that records on each node whether gradients (and inference mode) were
    on when the traced code made it. Buffers are traced like parameters (``get_attr`` nodes):
    fx's default hands the code the buffer itself, so an in-place update in ``forward``
    (``self.count.add_(1)``) would run once at trace time and never again."""

    proxy_buffer_attributes = True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InplaceProxy(node, self)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["traced_grad"] = torch.is_grad_enabled()
        node.meta["traced_inference"] = torch.is_inference_mode_enabled()
        return node


class _InplaceProxy(fx.Proxy):
    """``x += y`` traced as ``operator.iadd``, as Dynamo writes it (``fx.Proxy`` has no
    ``__iadd__``, so Python would trace ``x = x + y``: a write into an input or a view lost);
    ``functionalize`` rewrites the in-place op where the value is a tensor."""

    def __iadd__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.iadd, (self, other), {})

    def __isub__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.isub, (self, other), {})

    def __imul__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.imul, (self, other), {})

    def __itruediv__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.itruediv, (self, other), {})


def mark_grad_modes(gm: fx.GraphModule) -> None:
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    modes = [n.meta.get("traced_grad", True) for n in calls]
    if calls and not any(modes):
        gm.meta["grad"] = False
        gm.meta["inference"] = all(n.meta.get("traced_inference", False) for n in calls)
        return
    if all(modes):
        return
    # a block that turns gradients off: as ``torch.no_grad`` does, the mode before it is read
    # and restored after it (a call under no_grad then stays without gradients)
    graph, off, before = gm.graph, False, None
    for node in calls:
        want_off = not node.meta.get("traced_grad", True)
        if want_off != off:
            with graph.inserting_before(node):
                if want_off:
                    before = graph.call_function(torch.is_grad_enabled)
                    graph.call_function(torch._C._set_grad_enabled, (False,))
                else:
                    graph.call_function(torch._C._set_grad_enabled, (before,))
            off = want_off
    if off:
        with graph.inserting_before(graph.find_nodes(op="output")[0]):
            graph.call_function(torch._C._set_grad_enabled, (before,))
    gm.recompile()
