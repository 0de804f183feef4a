"""The ``torch.fx`` tracer of :func:`fusion_compiler.capture.capture`: gradient and inference
modes recorded on every node, buffers traced like parameters, augmented assignments
(``x += y``) traced as the in-place ops they are, the attributes ``forward`` reads recorded
(:func:`recording_reads`), and other threads left alone while it traces.

**Threads.** ``torch.fx``'s ``Tracer.trace`` changes the whole process while it runs: it sets
``nn.Module.__call__`` and ``nn.Module.__getattr__`` to wrappers that hand every module call
and parameter read to the tracer, and raises the module-level flag that ``torch.compile``'d
functions check ("Detected that you are using FX to symbolically trace a dynamo-optimized
function"). Another thread that called a module (or a ``torch.compile``'d function) during a
trace got proxies or that error. :class:`ModeRecordingTracer` passes calls and reads of other
threads through to the module untouched, raises the flag for its own thread only, and traces one
at a time (:data:`TRACE_LOCK`: two traces at once would each restore the other's patches).
fx raises its flag for every thread a few bytecodes before the tracer can make it a flag of one
thread (the tracer does so when fx sets its ``root``, before fx lists the model's modules): a
``torch.compile``'d function another thread calls exactly then could still raise Dynamo's error
(Dynamo's ``error_on_nested_fx_trace`` cannot help: its overrides are per thread in torch 2.13)."""

from __future__ import annotations

import contextlib
import logging
import operator
import sys
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.fx import _symbolic_trace

from .code_reads import users_module
from .ir.aliasing import tensor_result
from .ir.ops import TENSOR_HOOKS
from .output_types import OutputRecorder
from .parametrized_calls import traced_through
from .runtime.hooks import instance_forward
from .random_ops import RandomCallsAsNodes

__all__ = ["ModeRecordingTracer", "TRACE_LOCK", "recording_reads"]

log = logging.getLogger("fusion_compiler")
TRACE_LOCK = threading.Lock()
"""Held by :meth:`ModeRecordingTracer.trace` for the whole trace (see the module docstring)."""


@contextlib.contextmanager
def recording_reads(model: torch.nn.Module) -> Iterator[dict[torch.nn.Module, set[str]]]:
    """Record the attribute names read on each module of ``model`` whose code the trace runs
    (all but ``torch.nn``'s own, which fx keeps as leaves): for the block, each such module's
    class gets a ``__getattribute__`` that notes the names read on those modules (by identity)
    and then reads as before. The modules keep their class, so ``type(self) is Block`` and
    ``type(self).__mro__`` in ``forward`` see what they see when it runs. A module whose class
    cannot take the method is left out of the mapping. Traces record one at a time (a lock):
    two threads patching one class would leave it patched."""
    with _RECORDING:
        yield from _recording(model)


_RECORDING = threading.RLock()


def _recording(model: torch.nn.Module) -> Iterator[dict[torch.nn.Module, set[str]]]:
    reads: dict[torch.nn.Module, set[str]] = {}
    tables: dict[type, dict[int, set[str]]] = {}
    for module in dict.fromkeys(model.modules()):
        if not type(module).__module__.startswith("torch."):
            tables.setdefault(type(module), {})[id(module)] = reads.setdefault(module, set())
    patched = []
    for cls, table in tables.items():
        own = vars(cls).get("__getattribute__")
        read = cls.__getattribute__  # what its instances run now (its own or inherited)

        def __getattribute__(self: Any, name: str, _table: dict = table,
                             _read: Any = read) -> Any:
            names = _table.get(id(self))
            if names is not None:
                names.add(name)
            return _read(self, name)

        try:
            cls.__getattribute__ = __getattribute__
        except Exception:  # noqa: BLE001 (a class, or its metaclass, takes no new attribute)
            for module in list(reads):
                if type(module) is cls:
                    del reads[module]
            continue
        patched.append((cls, own))
    try:
        yield reads
    finally:
        for cls, own in reversed(patched):
            try:
                if own is None:
                    del cls.__getattribute__
                else:
                    cls.__getattribute__ = own
            except Exception:  # noqa: BLE001 (a metaclass that refuses: the others put back)
                log.warning("could not take the attribute recorder off %s after a trace: its "
                            "attribute reads stay slower", cls.__qualname__)


class ModeRecordingTracer(OutputRecorder, fx.Tracer):
    """``torch.fx.Tracer`` that records on each node whether gradients (and inference mode) were
    on when the traced code made it. Buffers are traced like parameters (``get_attr`` nodes):
    fx's default hands the code the buffer itself, so an in-place update in ``forward``
    (``self.count.add_(1)``) would run once at trace time and never again."""

    proxy_buffer_attributes = True
    _thread: int | None = None
    tensor_inputs: dict[str, int] = {}
    """``forward``'s arguments that are tensors in the call traced for, with their number of
    dimensions: their proxies, and those of parameters and buffers, are tensors to
    ``isinstance`` and answer ``dim()`` and ``ndim`` (:class:`_TensorProxy`)."""

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """fx's trace, recording in :attr:`autograd_functions` the ``torch.autograd.Function``
        classes the traced code applies (fx follows their ``forward``, under ``no_grad`` as
        ``apply`` runs it, and their ``backward`` is not in the graph), in :attr:`checkpoints`
        how many non-reentrant ``torch.utils.checkpoint`` calls it traced through, and in
        :attr:`autocast_entered` whether it entered a ``torch.autocast`` block (fx records no
        context manager: the block's ops would be traced in the caller's autocast state), and in
        :attr:`grad_mode_read` whether the traced code called ``torch.is_grad_enabled()`` (its
        answer is traced as a constant), and in :attr:`grad_mode_set` whether it set the mode
        (a ``torch.no_grad`` or ``torch.enable_grad`` block:
        :func:`~.grad_modes.forced_grad_modes`)."""
        self.autograd_functions: list[str] = []
        self.checkpoints = 0
        self.autocast_entered = False
        self.grad_mode_read = False
        self.grad_mode_set = False
        original = vars(torch.autograd.Function)["apply"]  # a classmethod
        autocast = torch.amp.autocast_mode.autocast
        enter = autocast.__enter__
        hooks = torch.autograd.graph.saved_tensors_hooks
        enter_hooks = hooks.__enter__

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if not self._elsewhere() and cls not in _TRACED_THROUGH:
                self.autograd_functions.append(cls.__qualname__)
            return original.__func__(cls, *args, **kwargs)

        def enter_autocast(block: Any) -> Any:
            if not self._elsewhere():
                self.autocast_entered = True
            return enter(block)

        is_grad_enabled = torch._C.is_grad_enabled
        queries = [(torch, torch.is_grad_enabled), (torch._C, is_grad_enabled)]

        def grad_mode() -> bool:
            # read by the traced code itself (not torch's own, as checkpoint's): a branch on it
            # is traced as a constant
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not self._elsewhere() and not caller.startswith(("torch", "fusion_compiler")):
                self.grad_mode_read = True
            return is_grad_enabled()

        set_grad_enabled = torch._C._set_grad_enabled

        def set_grad_mode(mode: bool) -> None:  # (torch.no_grad, enable_grad, decorators)
            if not self._elsewhere():
                self.grad_mode_set = True
            set_grad_enabled(mode)

        def enter_saved_tensors_hooks(block: Any) -> Any:
            # the non-reentrant checkpoint's hooks (torch 2.11 and 2.13 name them so)
            if not self._elsewhere() and type(block).__name__ == "_checkpoint_hook":
                self.checkpoints += 1
            return enter_hooks(block)

        with TRACE_LOCK:
            self._thread = threading.get_ident()
            torch.autograd.Function.apply = classmethod(apply)
            autocast.__enter__ = enter_autocast
            hooks.__enter__ = enter_saved_tensors_hooks
            for owner, _ in queries:  # torch.is_grad_enabled, and torch._C's of the same name
                owner.is_grad_enabled = grad_mode
            torch._C._set_grad_enabled = set_grad_mode
            try:
                with RandomCallsAsNodes(self):  # a random call on constants: a node, no draw
                    return super().trace(root, concrete_args)
            finally:
                torch.autograd.Function.apply = original
                autocast.__enter__ = enter
                hooks.__enter__ = enter_hooks
                for owner, query in queries:
                    owner.is_grad_enabled = query
                torch._C._set_grad_enabled = set_grad_enabled
                self._thread = None

    def _elsewhere(self) -> bool:
        """Whether the caller runs on another thread than the trace (see the module docstring)."""
        return threading.get_ident() != self._thread

    @property
    def root(self) -> torch.nn.Module:
        try:
            return self.__dict__["root"]
        except KeyError:
            raise AttributeError("root") from None

    @root.setter
    def root(self, module: torch.nn.Module) -> None:
        # fx's trace() sets the root a few bytecodes after it raised its process-wide flag (the
        # earliest step of trace() a tracer sees): the flag becomes one that reads as raised on
        # the tracing thread only (trace() puts the old value back)
        if self._thread is not None:
            _symbolic_trace._is_fx_tracing_flag = _TracingThread(self._thread)
        self.__dict__["root"] = module

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """fx's rule (``torch.nn``'s own modules are leaves, kept as ``call_module`` nodes),
        except that a module whose ``forward`` was replaced on the instance (a user's wrapper,
        an offloading library's hook) is traced through (``nn.Module.__call__`` runs that
        ``forward``, not the class's), and so is a parametrized module fx can trace, down to
        its parametrizations (:mod:`.parametrized_calls` says why, and what the others get)."""
        parametrize = torch.nn.utils.parametrize
        if instance_forward(m) is not None or isinstance(m, parametrize.ParametrizationList) or (
                parametrize.is_parametrized(m) and traced_through(m)):
            return False
        return super().is_leaf_module(m, module_qualified_name) or _torch_nn_forward(m)

    def call_module(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if self._elsewhere():  # another thread's call: the module runs as it would
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self._elsewhere():
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        if node.op == "placeholder" and node.target in self.tensor_inputs:
            return _TensorProxy(node, self, self.tensor_inputs[node.target])
        if node.op == "get_attr":
            value = self._attribute(str(node.target))
            if isinstance(value, torch.Tensor):
                kind = _ParameterProxy if isinstance(value, torch.nn.Parameter) else _TensorProxy
                return kind(node, self, value.dim())
        return _InplaceProxy(node, self)

    def _attribute(self, target: str) -> Any:
        """The tensor at ``target`` (a parameter or buffer of a module below the root), else
        ``None``; read from the modules' tables, not their ``__getattr__``, which fx has made
        the tracer's own for the length of the trace."""
        path, _, name = target.rpartition(".")
        module = self._submodule(path)
        if module is None:
            return None
        tables = vars(module)
        return tables.get("_parameters", {}).get(name, tables.get("_buffers", {}).get(name))

    def _submodule(self, path: str) -> torch.nn.Module | None:
        """The module at ``path`` below the root (``""``: the root), read from the modules'
        tables (see :meth:`_attribute`), else ``None``."""
        module = vars(self).get("root")
        for part in filter(None, path.split(".")):
            module = vars(module).get("_modules", {}).get(part) if isinstance(
                module, torch.nn.Module) else None
        return module if isinstance(module, torch.nn.Module) else None

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):  # (before fx's own test: a tensor proxy is a torch.Tensor
            return a.node            # to isinstance, and fx would make a constant of it)
        return super().create_arg(a)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if node.op == "placeholder":  # (what the model's isinstance is told: _InplaceProxy)
            node.meta["tensor"] = node.target in self.tensor_inputs
        elif node.op == "get_attr":
            node.meta["tensor"] = isinstance(self._attribute(str(node.target)), torch.Tensor)
        else:
            node.meta["tensor"] = tensor_result(node, self._submodule)
        node.meta["traced_grad"] = torch._C.is_grad_enabled()
        node.meta["traced_inference"] = torch.is_inference_mode_enabled()
        return node


def _torch_nn_forward(m: torch.nn.Module) -> bool:
    """Whether ``m``'s class inherits its ``forward`` from a ``torch.nn`` module fx keeps as a
    leaf (``class MyBN(nn.BatchNorm2d)`` with methods of its own, not ``forward``): its calls are
    the torch.nn module's. (Traced through, ``BatchNorm2d.forward`` fails: its input check is
    control flow on a traced value.)"""
    owner = next((c for c in type(m).__mro__ if "forward" in vars(c)), torch.nn.Module)
    return (owner is not torch.nn.Module and owner.__module__.startswith(("torch.nn.",
                                                                          "torch.ao.nn."))
            and not issubclass(owner, torch.nn.Sequential))


_TRACED_THROUGH = tuple(filter(None, [getattr(torch.utils.checkpoint, "_NoopSaveInputs", None)]))
"""``autograd.Function`` s a trace through keeps right: the non-reentrant checkpoint's."""


class _TracingThread:
    """fx's "tracing" flag, raised for one thread: true there, false on every other."""

    def __init__(self, thread: int | None):
        self.thread = thread

    def __bool__(self) -> bool:
        return threading.get_ident() == self.thread


class _InplaceProxy(fx.Proxy):
    """``x += y`` traced as ``operator.iadd``, as Dynamo writes it (``fx.Proxy`` has no
    ``__iadd__``, so Python would trace ``x = x + y``: a write into an input or a view lost);
    ``functionalize`` rewrites the in-place op where the value is a tensor. A read of what a
    graph cannot answer per call (``x.grad_fn is None``, ``hasattr(x, "_tag")``: fx's answer is
    a node, never ``None``, always there) fails the trace, naming it."""

    _is_param = _is_buffer = False  # (nn.Parameter's and nn.Buffer's isinstance read them)
    _kind: type = torch.Tensor  # (what the model's isinstance is told a tensor's proxy is)

    def __getattr__(self, name: str) -> Any:
        if name in _AUTOGRAD_STATE or (name.startswith("_") and not name.startswith("__")
                                       and not hasattr(torch.Tensor, name)):
            raise fx.proxy.TraceError(
                f"forward reads {name!r} of a traced value, which a graph cannot answer at "
                "each call (fx would answer it once, for all calls)")
        if name in TENSOR_HOOKS:
            raise fx.proxy.TraceError(
                f"forward calls {name}() on a traced value (a tensor hook): the tensor a "
                "traced graph computes is not one the code can keep or hook")
        return super().__getattr__(name)

    @property
    def __class__(self) -> type:  # type: ignore[override]
        # a value the trace knows to be a tensor (an input, parameter or buffer, a tensor op's
        # result: meta["tensor"]) is one to the model's isinstance, as in eager (fx's proxy is
        # none: the other branch was traced, silently); unsure, or asked by PyTorch: fx's answer
        if self.node.meta.get("tensor") and _asked_by_the_model(sys._getframe(1)):
            return self._kind
        return type(self)

    def __iadd__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.iadd, (self, other), {})

    def __isub__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.isub, (self, other), {})

    def __imul__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.imul, (self, other), {})

    def __itruediv__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.itruediv, (self, other), {})


class _TensorProxy(_InplaceProxy):
    """The proxy of a value the trace knows to be a tensor (an input that is one in the call
    traced for, a parameter, a buffer): to the model's own code, ``isinstance(x, torch.Tensor)``
    and ``torch.is_tensor(x)`` hold, as in eager (fx's proxy is no tensor, so ``forward``'s
    other branch was traced, silently); ``isinstance(x, nn.Parameter)`` holds for a parameter.
    Python's ``isinstance`` reads ``__class__`` where the type itself is not the class asked
    for: :class:`_InplaceProxy`'s property answers by who asks. PyTorch's own code
    (``torch.utils.checkpoint``, fx) and this package's get the proxy's class, as fx's proxies
    answer, which is what they are written to trace with; ``type(x)`` stays the proxy's."""

    def __init__(self, node: fx.Node, tracer: fx.Tracer, ndim: int):
        super().__init__(node, tracer)
        self.__dict__["_ndim"] = ndim

    def dim(self) -> int:
        """The number of dimensions, a number: a specialization's inputs have their shapes
        (its key), parameters and buffers theirs (replaced ones compile again), so ``if
        x.dim() == 3: x = x.unsqueeze(0)`` traces the branch eager takes."""
        return self._ndim

    @property
    def ndim(self) -> int:
        return self._ndim


class _ParameterProxy(_TensorProxy):
    """:class:`_TensorProxy` of a parameter: an ``nn.Parameter`` to the model's ``isinstance``
    (``torch.nn.parameter._ParameterMeta`` reads ``_is_param`` too)."""

    _is_param = True
    _kind = torch.nn.Parameter


_FORWARDERS = {("torch", "is_tensor"), ("torch.nn.parameter", "__instancecheck__")}
"""PyTorch functions that ask ``isinstance`` for their caller."""


def _asked_by_the_model(frame: Any) -> bool:
    """Whether the ``isinstance`` call in ``frame`` is the model's (not PyTorch's or this
    package's), seen through :data:`_FORWARDERS`."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if (module, frame.f_code.co_name) not in _FORWARDERS:
            return users_module(module)
        frame = frame.f_back
    return False


_AUTOGRAD_STATE = frozenset({"grad", "grad_fn", "_base", "_version", "retains_grad"})
