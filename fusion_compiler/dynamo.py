"""``torch.compile(model, backend="fusion_compiler")``: the Dynamo backend.

Installed (``pip install``), the package declares the backend as a ``torch_dynamo_backends``
entry point (``pyproject.toml``), which Dynamo loads and registers by itself, with or without
``import fusion_compiler``; from a source checkout on ``PYTHONPATH`` (no entry point),
``import fusion_compiler`` registers the name (:func:`register`).

Dynamo hands over one ``fx.GraphModule`` per graph between graph breaks, with example inputs that
are ``FakeTensor`` s. With ``torch._dynamo.config.inline_inbuilt_nn_modules`` (the default) the
module's parameters and buffers are graph inputs too, passed at every call; Dynamo marks them
(``nn.Parameter``, or a ``_dynamo_static_input_type`` attribute on the tensor). Each graph becomes
a :class:`DynamoGraph`: at its first real call those tensors are bound to the graph as its own
parameters and buffers (the very tensors, so optimizer steps and ``load_state_dict`` reach it),
and the graph with only the true inputs left is a :class:`~fusion_compiler.CompiledModule`,
compiled exactly as ``fusion_compiler.compile(model)`` compiles a model: the same passes and
regions, parameter-only work hoisted, the glue compiled by Inductor with each region one custom
op inside it, the whole graph (and a training backward) replayed as a CUDA graph, the first calls
answered at once while the plans build (``tiered``), one specialization per input signature (so
any batch sequence works, the dynamic ``SymInt`` inputs Dynamo adds after its first recompile
among them). Plans need shapes only, but cuDNN's are timed on real memory of those shapes, so
they are built at the first call of each signature, not from the fake inputs.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.machinery
import importlib.metadata
import operator
import sys
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .compiler import CompiledModule
from .config import CompileOptions
from .ir.ops import copy_graph

__all__ = ["fusion_compiler_backend", "DynamoGraph", "register", "BACKEND_NAME",
           "wait_for_background_compiles"]

BACKEND_NAME = "fusion_compiler"
_REGISTRY = "torch._dynamo.backends.registry"
_GROUP = "torch_dynamo_backends"


def fusion_compiler_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                            options: dict[str, Any] | None = None,
                            mode: str | None = None) -> "DynamoGraph":
    """Compile one Dynamo graph; returns the callable Dynamo runs in its place.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs (``FakeTensor`` s, ``SymInt`` s): which of them are
            the model's parameters and buffers is read from them.
        options: :func:`fusion_compiler.compile` options, given as
            ``torch.compile(..., options={...})``; ``compile()``'s defaults otherwise.
        mode: ``torch.compile``'s ``mode``
            (:meth:`~fusion_compiler.config.CompileOptions.for_dynamo`).

    Raises:
        TypeError: an unknown option.
        ValueError: an invalid option value or ``mode``.
        FusionError: the graph cannot be retraced or breaks the cuDNN graph rules (on first call).
    """
    return DynamoGraph(gm, example_inputs, CompileOptions.for_dynamo(options, mode))


_LIVE: "weakref.WeakSet[DynamoGraph]" = weakref.WeakSet()
"""The graphs this backend compiled that Dynamo still holds."""


def wait_for_background_compiles(timeout: float | None = None) -> bool:
    """Block until the background compiles (option ``tiered``: plans, then Inductor's glue) of
    every graph the ``torch.compile`` backend compiled have ended, at most ``timeout`` seconds
    in all, and switch them to their last tier now (the door's
    :meth:`fusion_compiler.CompiledModule.wait_for_background_compiles`). Returns ``False`` if
    the timeout passed first. Benchmarks call it before timing the steady state."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for graph in list(_LIVE):
        for compiled in graph.bindings:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not compiled.wait_for_background_compiles(left):
                return False
    return True


def _picker(positions: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``args -> tuple(args[i] for i in positions)``, as one C call."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        return lambda args: (args[positions[0]],)
    return operator.itemgetter(*positions)


def _is_model_state(example: Any) -> bool:
    """Whether a Dynamo graph input is one of the model's parameters or buffers (or a tensor the
    user marked static with ``torch._dynamo.mark_static_address``)."""
    return isinstance(example, torch.nn.Parameter) or (
        isinstance(example, torch.Tensor)
        and getattr(example, "_dynamo_static_input_type", None) is not None)


class DynamoGraph:
    """One Dynamo graph, compiled at its first call: called with every input Dynamo passes
    (model state and true inputs, in the graph's placeholder order), returns the graph's outputs.

    The model state is bound by identity: a call passing other parameter or buffer tensors
    (Dynamo reuses a graph for another instance of the same module class without a guard on
    them) compiles a binding of its own; ``options.max_specializations`` bindings are kept, the
    least recently used evicted.

    Attributes:
        options: the options every binding compiles with.
        compiled_module: the :class:`~fusion_compiler.CompiledModule` of the last call's binding
            (``None`` before the first call): ``.report()``, ``.specializations``.

    Raises (on call): what :class:`~fusion_compiler.CompiledModule` raises.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 options: CompileOptions):
        self.gm, self.options = gm, options
        self._state = [i for i, e in enumerate(example_inputs) if _is_model_state(e)]
        taken = set(self._state)
        self._inputs = [i for i in range(len(example_inputs)) if i not in taken]
        self._state_of = _picker(self._state)
        self._inputs_of = _picker(self._inputs)
        self._bindings: collections.OrderedDict[tuple[int, ...], CompiledModule] = \
            collections.OrderedDict()
        self._bound: tuple[Any, ...] | None = None  # the state of the last call's binding
        self.compiled_module: CompiledModule | None = None
        _LIVE.add(self)

    def __call__(self, *args: Any) -> Any:
        state = self._state_of(args)
        if self._bound is None or not all(map(operator.is_, state, self._bound)):
            self.compiled_module = self._binding(list(state))
            self._bound = state
        assert self.compiled_module is not None
        return self.compiled_module.forward(*self._inputs_of(args))  # (no module hooks)

    @property
    def bindings(self) -> list[CompiledModule]:
        """The compiled module of each binding kept, the least recently used first."""
        return list(self._bindings.values())

    def report(self) -> str:
        """:meth:`fusion_compiler.CompiledModule.report` of the last call's binding."""
        if self.compiled_module is None:
            return "not compiled yet: call the compiled model once"
        return self.compiled_module.report()

    def _binding(self, state: list[Any]) -> CompiledModule:
        key = tuple(map(id, state))
        compiled = self._bindings.get(key)
        if compiled is None:
            compiled = CompiledModule(self._bind(state), self.options)
            self._bindings[key] = compiled
            while len(self._bindings) > self.options.max_specializations:
                self._bindings.popitem(last=False)
        self._bindings.move_to_end(key)
        return compiled

    def _bind(self, state: list[Any]) -> fx.GraphModule:
        """A copy of the graph in which the state inputs are attributes holding ``state``
        (parameters as parameters, other tensors as buffers) and the other inputs remain."""
        graph = copy_graph(self.gm.graph)
        placeholders = graph.find_nodes(op="placeholder")
        root: dict[str, Any] = {}
        for node in graph.nodes:  # what the graph itself refers to
            if node.op in ("get_attr", "call_module"):
                root[node.target] = operator.attrgetter(node.target)(self.gm)
        for node in placeholders:  # Dynamo's record of the input holds a weak reference,
            node.meta.pop("grapharg", None)  # which Inductor's cache key cannot pickle
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        for k, value in zip(self._state, state):
            node = placeholders[k]
            name = f"_state_{k}"
            root[name] = value
            with graph.inserting_before(first_op):
                attr = graph.get_attr(name)
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
        bound = fx.GraphModule(root, graph, class_name=type(self.gm).__name__)
        bound.train(self.gm.training)
        return bound


def _installed() -> bool:
    """Whether an installed distribution declares this backend as a ``torch_dynamo_backends``
    entry point: then Dynamo loads it by that name itself."""
    return BACKEND_NAME in importlib.metadata.entry_points(group=_GROUP).names


def _register_now(registry: Any) -> None:
    """Add the backend to Dynamo's ``registry`` module, unless an installed entry point declares
    it or a backend of that name is there. Dynamo registers an entry point's backend itself when
    it first looks the name up, after loading it (which imports this package): registered here
    too, its own registration then failed ("duplicate name")."""
    if _installed():
        return
    try:
        registry.register_backend(fusion_compiler_backend, name=BACKEND_NAME)
    except AssertionError:  # "duplicate name": registered already (e.g. a second import path)
        pass


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when Python looks for Dynamo's backend registry module, it lets the
    normal path finder load it and then registers the backend in it (see :func:`register`)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            _register_now(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register() -> None:
    """Make ``torch.compile(model, backend="fusion_compiler")`` find this backend by name.

    Dynamo looks names up in ``torch._dynamo.backends.registry``. Importing ``torch._dynamo``
    is slow (measurements: docs/decisions.md, "Keeping ``import fusion_compiler`` light"), so
    when it is not imported yet the backend is registered the moment it is (a ``sys.meta_path``
    finder that wraps the registry module's loader), and ``import fusion_compiler`` stays fast.
    Called by ``import fusion_compiler``; calling it again does nothing.
    """
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _register_now(registry)
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
