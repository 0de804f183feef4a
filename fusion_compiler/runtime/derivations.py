"""What an inference CUDA graph derives from the module's state, and how the graph keeps it
current: every replay starts with a prologue that recomputes the derived tensors whose sources
changed, found by their contents (:mod:`.derive`).

Two kinds of derived tensors:

- the **hoisted values** of the graph (parameter-only subgraphs moved out of the forward,
  :mod:`fusion_compiler.passes.post_lowering.hoist`): each output is translated node by node into
  an :class:`~.derive.Expr` (views, permutes, concatenation, padding, expansion, scaling by a
  constant, products of two tensors, casts); a node outside that algebra, and what depends on it,
  is *opaque*: computed with PyTorch ops at every replay (small values: a batch norm's folded
  scale and shift), the same op of every batch norm as one multi-tensor op
  (:mod:`.multi_tensor`);
- the **kernels' values** (:class:`~.weight_cache.WeightCache`): recorded at the warm-up call
  that precedes capture, where each cache called with state tensors gets a persistent tensor of
  its own, described by applying its conversion to the inputs' expressions.

:class:`Derivations` is the scope (:func:`~.weight_cache.derivation_scope`) under which warm-up
and capture run, and :meth:`Derivations.prologue` is what the graph runs first. Without Triton
(or off CUDA) the program recomputes every derived tensor at each replay with PyTorch ops.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from .multi_tensor import batched
from .derive import Expr, NotDerivable, Program, evaluator
from .tensors import capture_owner, stream_capturing
from .weight_cache import WeightCache, cache_key

__all__ = ["Derivations", "expressions"]

log = logging.getLogger("fusion_compiler")

_REARRANGING_FUNCTIONS = {
    torch.reshape, torch.permute, torch.cat, torch.concat, torch.stack, torch.flatten,
    torch.transpose, torch.narrow, torch.squeeze, torch.unsqueeze, torch.t, torch.select,
    torch.movedim, torch.clone, torch.repeat_interleave, operator.getitem, F.pad,
}
_REARRANGING_METHODS = {
    "reshape", "view", "permute", "expand", "contiguous", "clone", "flatten", "unsqueeze",
    "squeeze", "transpose", "t", "narrow", "select", "repeat", "movedim", "expand_as", "view_as",
    "reshape_as",
}
_CASTS = {"to", "float", "half", "bfloat16", "type", "detach"}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _apply(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with its :class:`Expr` arguments rearranged array by array."""
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, a in enumerate(flat) if isinstance(a, Expr)]

    def call(*arrays: torch.Tensor) -> Any:
        values = list(flat)
        for i, a in zip(where, arrays):
            values[i] = a
        a, k = tree_unflatten(values, spec)
        return fn(*a, **k)

    return Expr.rearranged(call, *[flat[i] for i in where])


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rule(node: fx.Node, args: tuple, kwargs: dict) -> Expr:
    """The :class:`Expr` of ``node`` from its arguments' (some :class:`Expr`).

    Raises:
        NotDerivable: ``node`` is outside the algebra."""
    target = node.target
    exprs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Expr)]
    if not exprs:
        raise NotDerivable("no tensor argument")
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    if node.op == "call_method" and name in _CASTS or target in (torch.Tensor.to,):
        return args[0]
    if target is F.pad and (kwargs.get("mode", "constant") != "constant"
                            or (kwargs.get("value") or (args[3] if len(args) > 3 else 0))):
        raise NotDerivable("padding with a value other than zero")
    if node.op == "call_method" and name in _REARRANGING_METHODS:
        return _apply(lambda self, *a, **k: getattr(self, name)(*a, **k), args, kwargs)
    if node.op == "call_function" and target in _REARRANGING_FUNCTIONS:
        return _apply(target, args, kwargs)
    binary = {torch.mul: "mul", operator.mul: "mul", torch.div: "div", operator.truediv: "div",
              torch.neg: "neg", operator.neg: "neg"}.get(target)
    if node.op == "call_method" and name in ("mul", "div", "neg"):
        binary = name
    if binary == "neg":
        return args[0].scaled(-1.0)
    if binary in ("mul", "div") and len(args) == 2 and not kwargs:
        a, b = args
        if isinstance(a, Expr) and _number(b):
            return a.scaled(b if binary == "mul" else 1.0 / b)
        if binary == "mul" and _number(a) and isinstance(b, Expr):
            return b.scaled(a)
        if binary == "mul" and isinstance(a, Expr) and isinstance(b, Expr):
            return a.times(b)
    raise NotDerivable(f"{node.op} {name or target}")


def expressions(graph: fx.Graph, leaf: Callable[[fx.Node], Expr | None]) -> dict[fx.Node, Expr]:
    """The nodes of ``graph`` (a graph of parameter-only work) that the gather algebra describes,
    with their :class:`Expr`; ``leaf(node)`` gives a ``get_attr`` node's (``None``: opaque).
    Nodes missing from the result are opaque."""
    known: dict[fx.Node, Expr] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            expr = leaf(node)
            if expr is not None:
                known[node] = expr
            continue
        if node.op not in ("call_function", "call_method"):
            continue
        if any(isinstance(a, fx.Node) and a not in known for a in node.all_input_nodes):
            continue
        try:
            args = fx.node.map_arg(node.args, known.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, known.__getitem__)
            value = _rule(node, args, kwargs)
        except NotDerivable:
            continue
        except Exception:  # noqa: BLE001 - an op the rule misjudged: treat it as opaque
            continue
        if isinstance(value, Expr):
            known[node] = value
    return known


class Derivations:
    """The derivation scope of one inference CUDA-graph runner (see the module docstring).

    Args:
        state: the module's parameters and buffers the graph reads (the sources).
        hoisted: the graph's hoisted values, or ``None``: an object with ``graph_module`` (its
            code: ``get_attr`` nodes of the state, one output tuple), ``names`` (one per output)
            and ``owner`` (the module holding the output tensors under those names).
        unguarded: names of hoisted values read by ops other than regions (made before the
            forward, not beside it).
        frozen: the state is constant (option ``freezing``): the derived tensors are made before
            the capture and graphs hold no prologue.

    Attributes:
        notes: what the prologue computes with PyTorch ops at every replay, and why.
    """

    def __init__(self, state: Sequence[torch.Tensor], hoisted: Any = None,
                 unguarded: Sequence[str] = (), frozen: bool = False):
        self.hoisted, self.frozen = hoisted, frozen
        self.notes: list[str] = []
        self._order: dict[int, None] = {}  # derived tensors' storages, in order of first use
        self._early: set[int] = set(  # read by ops that do not tell: ready before the forward
            _storage(getattr(hoisted.owner, name)) for name in unguarded)
        self._late: set[int] = set()
        self._ready: torch.cuda.Event | None = None  # the side stream's derivation, captured
        self._joined: set[int] = set()  # streams that waited for it
        self.early: Program | None = None
        self._static = {_storage(t) for t in state if isinstance(t, torch.Tensor)}
        self._sources: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}
        self._derived: dict[int, tuple[torch.Tensor, Expr]] = {}  # storage -> (tensor, expr)
        self._cached: dict[tuple, Any] = {}  # (cache, inputs) -> value
        self._fallbacks: list[Callable[[], None]] = []
        self._opaque: Callable[[], None] | None = None
        self.program: Program | None = None
        if hoisted is not None:
            self._translate(hoisted)

    # ------------------------------------------------------------------ sources
    def _slot(self, t: torch.Tensor) -> int:
        key = _storage(t)
        if key not in self._slots:
            self._slots[key] = len(self._sources)
            self._sources.append(t)
        return self._slots[key]

    def _expr_of(self, x: torch.Tensor) -> Expr | None:
        """``x``'s elements as an :class:`Expr`: of a derived tensor's expression where ``x``
        views one, of a source where it views state; ``None`` otherwise."""
        derived = self._derived.get(_storage(x))
        if derived is not None:
            base, expr = derived
            memory = Expr.rearranged(lambda a: torch.empty_strided(
                tuple(base.shape), base.stride(), dtype=a.dtype).copy_(a).as_strided(
                tuple(x.shape), x.stride(), x.storage_offset() - base.storage_offset()), expr)
            return memory
        if _storage(x) in self._static and x.dtype in (torch.float16, torch.bfloat16,
                                                       torch.float32):
            return Expr.source(self._slot(x), x)
        return None

    # ------------------------------------------------------------------ hoisted values
    def _translate(self, hoisted: Any) -> None:
        gm = hoisted.graph_module
        graph = gm.graph
        output = graph.find_nodes(op="output")[0]
        outs = list(output.args[0])
        targets = [getattr(hoisted.owner, name) for name in hoisted.names]

        def leaf(node: fx.Node) -> Expr | None:
            t = operator.attrgetter(node.target)(gm)
            return self._expr_of(t) if isinstance(t, torch.Tensor) else None

        known = expressions(graph, leaf)
        opaque_outputs = [(n, t) for n, t in zip(outs, targets) if n not in known]
        for node, target in zip(outs, targets):
            if node in known:
                self._derived[_storage(target)] = (target, known[node])
        if opaque_outputs:
            self.notes.append(f"{len(opaque_outputs)} hoisted value(s) computed with PyTorch ops "
                              "at every replay (outside the gather algebra)")
            sub = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            for node in graph.nodes:
                if node.op != "output":
                    env[node] = sub.node_copy(node, lambda a: env[a])
            sub.output(tuple(env[n] for n, _ in opaque_outputs))
            sub.eliminate_dead_code()
            compute = fx.GraphModule(gm, batched(sub))  # a batch norm's fold: 6 ops, one chain each
            buffers = [t for _, t in opaque_outputs]

            def run_opaque() -> None:
                with torch.no_grad():
                    torch._foreach_copy_(buffers, list(compute()))

            self._opaque = run_opaque
            for t in buffers:  # what reads them is fingerprinted after they are computed
                self._static.add(_storage(t))

    # ------------------------------------------------------------------ kernels' values
    def lookup(self, cache: WeightCache, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The value of ``cache`` for ``tensors`` (what :class:`WeightCache` calls in this
        scope): a persistent tensor recorded at its first call (before capture) when every input
        is state or derived from it; otherwise made now (in a capture: at every replay)."""
        key = (id(cache), cache_key(tensors))
        if key in self._cached:
            value = self._cached[key][1]
            self.reads(value if isinstance(value, tuple) else (value,))
            return value
        exprs = [self._expr_of(t) for t in tensors]
        if any(e is None for e in exprs) or stream_capturing():
            self.reads(tensors)
            return cache.convert(*tensors)
        value = cache.convert(*tensors)
        outputs = value if isinstance(value, tuple) else (value,)
        described = None
        if cache.describe is not None:
            try:
                described = cache.describe(*exprs)
            except NotDerivable:
                described = None
        if described is not None:
            described = described if isinstance(described, tuple) else (described,)
            for out, expr in zip(outputs, described):
                self._derived[_storage(out)] = (out, expr)
        else:
            self.notes.append(f"a {type(cache.convert).__name__} value recomputed with PyTorch "
                              "ops at every replay")

            def again(outputs=outputs, cache=cache, tensors=tensors) -> None:
                fresh = cache.convert(*tensors)
                for out, new in zip(outputs, fresh if isinstance(fresh, tuple) else (fresh,)):
                    out.copy_(new)

            self._fallbacks.append(again)
        self._cached[key] = (cache, value)  # the cache object kept: its id stays unique
        self.reads(outputs)
        return value

    def reads(self, tensors: Sequence[Any]) -> None:
        """A kernel is about to read ``tensors`` (what region kernels and :meth:`lookup` call):
        at the warm-up call, the order derived tensors are first used in; in a capture, the
        current stream waits for the side stream's derivation before its first read of one."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage(t)
            if key not in self._derived:
                continue
            if self._ready is None:
                self._order.setdefault(key)
            elif key in self._late:
                self.join()
                return

    # ------------------------------------------------------------------ the prologue
    def build(self) -> None:
        """Make the programs from what was translated and recorded (after the warm-up call): the
        derived tensors first used early (up to :data:`EARLY_ELEMENTS`) or read by ops that do not
        tell (:meth:`reads`) are recomputed at every replay, before the forward, by one kernel;
        the others by the fingerprint and derivation kernels on a side stream, which the forward
        waits for at its first read of one of them."""
        order = [*self._order, *(k for k in self._derived if k not in self._order)]
        early, late, size = [], [], 0
        for key in order:
            target, expr = self._derived[key]
            try:
                Program.check(target, expr)
            except NotDerivable as exc:
                self.notes.append(f"a derived tensor recomputed at every replay: {exc}")
                self._fallbacks.append(_copier(target, evaluator(expr, self._sources)))
                continue
            size += target.numel()
            first = key in self._early or key not in self._order or size <= EARLY_ELEMENTS
            (early if first else late).append((target, expr))
        self.early = Program(self._sources, early, conditional=False) if early else None
        self.program = Program(self._sources, late)
        if self.program.derived and not self.program.reason:
            self.program.run(always=True)  # loads the kernel a caller's own capture launches
        self._late = {_storage(t) for t, _ in late}
        if self.program.reason:
            self.notes.append(f"derived tensors recomputed at every replay: "
                              f"{self.program.reason}")

    def prologue(self) -> None:
        """Bring the derived tensors up to date with the state: opaque values, fallbacks and the
        early program on the current stream; the fingerprinted program after them, on a side
        stream when this package captures (:meth:`reads` and :meth:`join` wait for it), else in
        turn. In a capture of the caller's own (no :func:`~.tensors.capture_owner`), every
        derived tensor is rewritten at every replay, in turn: the caller may replay that graph
        at the same time as this runner's graphs, and the fingerprint's sums and counter
        (one set per program) must see one launch at a time."""
        if self.frozen and stream_capturing():  # constants: derived once, before the capture
            return
        if self._opaque is not None:
            self._opaque()
        for again in self._fallbacks:
            again()
        if self.early is not None:
            self.early.run()
        if self.program is None:
            return
        if not stream_capturing() or self.program.reason or not self.program.derived:
            self.program.run()
            return
        if capture_owner() is None:  # the caller's own graph
            self.program.run(always=True)
            return
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.program.run()
        self._ready, self._joined = torch.cuda.Event(), set()
        self._ready.record(side)
        self._side = side  # kept until the capture ends

    def finish(self) -> None:
        """The end of a capture's forward: join the side stream, forget the capture's event
        (also when the join fails: in a capture that failed, the event belongs to no graph, and
        a later wait on it raises "invalid argument")."""
        try:
            self.join()
        finally:
            self._ready = self._side = None

    def join(self) -> None:
        """The current stream waits for the side stream's derivation (once per stream and
        capture); a capture calls it at its end too, which must join every stream it forked."""
        stream = torch.cuda.current_stream()
        if self._ready is not None and stream.cuda_stream not in self._joined:
            stream.wait_event(self._ready)
            self._joined.add(stream.cuda_stream)


EARLY_ELEMENTS = 1 << 17
"""Elements of derived tensors, in order of first use, recomputed at every replay by one kernel
before the forward (SE-ResNet9's stem and first block: 77k) rather than fingerprinted beside it:
the forward's first kernels read them at once (measurements: docs/decisions.md, "Derived weights:
a content fingerprint, not version counters")."""


def _copier(target: torch.Tensor, value: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def copy() -> None:
        with torch.no_grad():
            target.copy_(value().to(target.dtype))
    return copy
