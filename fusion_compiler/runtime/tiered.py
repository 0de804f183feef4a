"""Tiered compilation: serve calls from a quick first tier while a faster tier is made.

A specialization whose glue is compiled by Inductor would otherwise make its first call wait for
Inductor, and one whose plans are not cached would wait for their builds: seconds each
(measurements: docs/decisions.md, "Tiered compilation"). With tiering, a quick tier answers at
once: tier 0 runs the regions as their own PyTorch ops (:func:`unlowered_copy`) while the
background thread builds or loads the plans (:mod:`.background`); tier 1 the lowered regions with
the glue as eager PyTorch ops, in a CUDA graph; tier 2 the glue compiled by Inductor (no tier 2
when the glue leaves Inductor nothing to compile, see
:func:`fusion_compiler.glue_compile.glue_backend`). Inductor's compile traces (AOTAutograd's
``make_fx``), which touches process-global state: it runs on the calling thread, at the call
after tier 1's first (that call takes the compile's time), never on the background thread. A
switch (lowering, compiling, capturing on the calling thread) frees the tier before. A
:class:`TieredRunner` holds two tiers; tier 0's second is itself a :class:`TieredRunner` when
Inductor compiles the glue. The tiers compute the same function; outputs may differ in the
last bits (Inductor's fused glue and cuDNN's plans round differently from eager ops).

While the background thread works, it holds the GIL in Python's switch-interval slices (5 ms), so
calls in that window can take longer. Tier 0's lowering on it runs no kernel of a region and times
nothing (tier 0's plans build in worker processes, and their timing waits for the switch); it
holds :data:`~.background.COMPILE_LOCK` from start to end, so a new specialization's compile on
the calling thread waits for it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ir.ops import copy_graph, shallow_module
from ..ir.region import Region
from .background import submit
from .tensors import stream_capturing

__all__ = ["TieredRunner", "isolated_copy", "unlowered_copy"]

class _Opaque(torch.nn.Module):
    """Calls ``module`` without registering it: its parameters and submodules stay out of
    ``named_parameters()``/``named_modules()`` of whatever holds this wrapper.

    Pickles as a description of what a wrapped region computes (:func:`_region_description`),
    not as its contents: AOTAutograd's cache key pickles every submodule of the graph it is given,
    and a region's kernel holds cuDNN plans and weak references that do not pickle, so AOTAutograd
    bypassed its cache for every glue graph. Copies wrap the same module."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "target", module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        if not isinstance(self.target, Region):
            raise TypeError(f"cannot pickle an opaque {type(self.target).__name__}")
        return (_unpickled_opaque, (_region_description(self.target),))

    def __copy__(self) -> "_Opaque":
        return _Opaque(self.target)

    def __deepcopy__(self, memo: dict) -> "_Opaque":
        return _Opaque(self.target)


def _region_description(region: Region) -> str:
    """What a trace of ``region`` produces depends on: its kernel's class and ``run_region`` key
    (a hash of what the kernel computes, see :mod:`fusion_compiler.runtime.region_op`), the
    region's code and its outputs' shapes, strides and dtypes."""
    owner = getattr(region.kernel, "__self__", region.kernel)
    return repr((type(owner).__qualname__, getattr(owner, "key", None),
                 region.graph_module.code, region.output_specs()))


def _unpickled_opaque(description: str) -> None:
    """What an unpickled :class:`_Opaque` would be: nothing can run it in another process."""
    raise TypeError(f"a fused region does not unpickle: {description[:80]}")


def _private(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` (and of its submodules) whose parameter, buffer and submodule
    tables are its own: the same tensor objects, but replacing one on the copy leaves ``module``
    alone."""
    return shallow_module(module, child=_private)


def isolated_copy(gm: fx.GraphModule, opaque: Callable[[torch.nn.Module], bool],
                  substitute: Callable[[torch.nn.Module], torch.nn.Module | None] | None = None
                  ) -> fx.GraphModule:
    """``gm`` with no module object shared with the model it came from, for a compile on another
    thread.

    AOTAutograd (under ``torch._inductor.compile``) traces a module by swapping its parameters
    and buffers for fake tensors, attribute by attribute, for the length of the trace. A graph
    module traced from a model holds the model's own leaf modules (an ``nn.Linear`` of the SE
    gate, a convolution whose region replaced its call), so a trace on one thread would swap them
    under a forward the calling thread runs at the same time (it then read fake tensors: "Cannot
    access data pointer of Tensor (e.g. FakeTensor...)"). In the copy every ``get_attr`` and
    ``call_module`` target is a flat attribute of a new root: tensors are the same objects (in-place
    updates, e.g. by an optimizer or ``HoistedParameters.refresh``, reach the compiled code), leaf
    modules are :func:`_private` copies, and modules for which ``opaque(module)`` holds (regions,
    which hold no state the trace needs) are called through a wrapper that hides their contents.
    ``substitute(module)``, when given and not ``None``, is called instead of ``module``.
    """
    graph = copy_graph(gm.graph)
    for node in graph.nodes:  # what AOTAutograd's cache asks of a graph (else it bypasses)
        if node.op == "placeholder" and isinstance(node.type, str):
            node.type = None  # an annotation kept as text: a string among the code's globals
        if isinstance(node.meta.get("val"), torch.Tensor):
            node.meta.setdefault("example_value", node.meta["val"])  # tensors, as Dynamo marks
    root = torch.nn.Module()
    names: dict[tuple[str, str], str] = {}
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        key = (node.op, node.target)
        if key not in names:
            names[key] = name = f"_{node.op}_{len(names)}"
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                other = substitute(module) if substitute is not None else None
                setattr(root, name, other if other is not None else
                        _Opaque(module) if opaque(module) else _private(module))
            else:
                *path, field = node.target.split(".")
                value = getattr(gm.get_submodule(".".join(path)), field)
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    root.register_buffer(name, value)
                else:
                    setattr(root, name, value)
        node.target = names[key]
    return fx.GraphModule(root, graph)


def unlowered_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """An :func:`isolated_copy` of ``gm`` in which each region runs its own PyTorch ops: a graph
    module made from a copy of the region's graph, so that lowering ``gm`` (kernels, the layout
    edits of :mod:`fusion_compiler.passes.post_lowering.layout`, which rewrite a region's graph in
    place) on another thread leaves it alone. Inputs and outputs as ``gm``'s, computed as eager
    PyTorch would (NCHW)."""

    def region_ops(module: torch.nn.Module) -> torch.nn.Module | None:
        if not isinstance(module, Region):
            return None
        return fx.GraphModule(module.graph_module, copy_graph(module.graph_module.graph))

    return isolated_copy(gm, opaque=lambda m: False, substitute=region_ops)


class TieredRunner:
    """Calls go to ``first`` until ``build()``, run by :func:`~.background.submit` after the first
    call (or at :meth:`wait`), has finished; the next call then switches to ``finish(build())``
    and closes ``first``. Without ``build`` (a second tier made only on the calling thread, such
    as Inductor's compile of the glue, which traces) the switch happens at the call after the
    first, or at :meth:`wait`.

    Args:
        first: the first tier's callable (``close()`` is called on it, if it has one, after the
            switch).
        build: the background part of the second tier's compile (runs on the background thread:
            the rule of :mod:`.background` applies), or ``None``.
        finish: turns ``build``'s result (``None`` without ``build``) into the second tier's
            callable, on the calling thread (e.g. captures its CUDA graph).
        on_failure: called with a one-line reason when ``build`` or ``finish`` raised; calls then
            stay on ``first``.

    Calls from several threads run one at a time, so the switch never closes a tier under
    another thread's call; no switch happens inside the caller's own CUDA graph capture.

    Attributes:
        tier: 1 while calls go to ``first``, 2 after the switch.
    """

    def __init__(self, first: Callable[..., Any], build: Callable[[], Any] | None,
                 finish: Callable[[Any], Callable[..., Any]],
                 on_failure: Callable[[str], None]):
        self.run, self.tier = first, 1
        self._build, self._finish, self._on_failure = build, finish, on_failure
        self._future: concurrent.futures.Future | None = None
        self._lock = threading.RLock()  # calls and the switch, one thread at a time

    def _start(self) -> None:
        """Submit the build (once). Deferred to the end of the first call, so the background
        thread does not hold the GIL while the first output is being made."""
        if self._future is not None or self._finish is None:
            return
        if self._build is None:  # nothing for the background: ready at the next call
            self._future = concurrent.futures.Future()
            self._future.set_result(None)
            return
        me = weakref.ref(self)  # a runner dropped before its turn costs no compile
        self._future = submit(lambda: None if (runner := me()) is None or
                              runner._build is None else runner._build())

    def __call__(self, *args: Any) -> Any:
        with self._lock:  # a tier is not closed under another thread's call
            if self._future is not None and self._future.done() and not stream_capturing():
                self._switch()  # (not inside the caller's own CUDA graph capture: it captures)
            out = self.run(*args)
            if self._future is None and self.tier == 1:
                self._start()
            return out

    @property
    def pending(self) -> bool:
        """Whether the second tier is still to come (not yet switched to, nor failed), or, when
        the second tier is itself a :class:`TieredRunner`, whether its own is."""
        return self._finish is not None or bool(getattr(self.run, "pending", False))

    def wait(self, timeout: float | None = None, nested: bool = True) -> bool:
        """Block until the background compile ends (at most ``timeout`` s), then switch tiers on
        this thread; when the second tier is itself a :class:`TieredRunner` (and ``nested``),
        wait for its switch too, in what is left of ``timeout``. Returns ``False`` when the
        timeout passed first, else ``True`` (also when a compile failed: calls then stay on the
        tier before it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._start()
            future = self._future  # (None once another thread switched)
        if future is not None:
            done, _ = concurrent.futures.wait([future], timeout=timeout)
            if not done:
                return False
            self._switch()
        if nested and isinstance(self.run, TieredRunner):
            return self.run.wait(None if deadline is None
                                 else max(0.0, deadline - time.monotonic()))
        return True

    def _switch(self) -> None:
        with self._lock:
            future, self._future = self._future, None
            if future is None:  # another thread switched meanwhile
                return
            finish, on_failure = self._finish, self._on_failure
            self._build = self._finish = self._on_failure = None  # their example inputs: freed
            settle = getattr(self.run, "settle", None)
            if settle is not None:  # the next tier's build writes tensors the first one reads:
                settle()  # not before the first tier's last call has run on the GPU
            try:
                second = finish(future.result())
            except Exception as exc:  # the compile or the capture failed: stay on the first tier
                on_failure(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
                return
            first, self.run, self.tier = self.run, second, 2
            close = getattr(first, "close", None)
            if close is not None:
                close()

    def close(self) -> None:
        """Drop the pending compile (its result is discarded) and close the current tier (after
        a call running on another thread)."""
        with self._lock:
            if self._future is not None:
                self._future.cancel()
            self._future = self._build = self._finish = self._on_failure = None
            close = getattr(self.run, "close", None)
            if close is not None:
                close()
