"""Shape propagation: the tensor metadata of a captured graph's nodes.

Shapes, dtypes and strides are propagated by running the graph once on copies of the real inputs
when that is cheap (the pass manager decides, see :class:`~fusion_compiler.passes.PassManager`),
else without real data: on tensors of PyTorch's ``meta`` device (no memory, no kernels; each op's
meta function computes its output's shape, dtype and strides), or, under ``torch.autocast`` and
for inputs that are already ``FakeTensor`` s, with fake tensors
(``torch.fx.passes.fake_tensor_prop``). The first meta or fake propagation imports
``torch._dynamo`` (fake tensors on construction, meta tensors through the Python meta functions of
``torch._refs``) and sympy (the convolution's meta function), which takes seconds (measurements:
docs/decisions.md, "Shape propagation on real inputs under a 0.2 s budget"). The pass manager also
caches what was propagated (:func:`encode_meta`, :func:`apply_meta`). After
:func:`propagate_shapes` every node's ``meta["val"]`` holds a meta tensor or ``FakeTensor`` (or a
Python value/tuple of them for shape arithmetic and multi-output nodes) and ``meta["device"]`` the
device the value lives on when the graph runs (:func:`~fusion_compiler.ir.ops.node_device`).

No propagation writes or swaps the model's own tensors: a run that may write them (batch norm's
running statistics in training mode, an update in ``forward``, an optimizer's step) reads copies
of them instead (:class:`_PrivateState`), and module calls read meta copies of their parameters
from a copy of the module. Another thread that uses the model meanwhile (a trainer beside an
actor) sees neither a meta tensor nor an update undone.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .ir.aliasing import shared_input
from .ir.ops import (meta_like, registers_tensor_hook, shallow_module, write_back,
                     writes_in_place)
from .random_ops import NoDraws, may_draw

__all__ = ["propagate_shapes", "written_state", "encode_meta", "apply_meta"]


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any],
                     real: bool = False) -> fx.GraphModule:
    """Fill ``node.meta["val"]`` and ``node.meta["device"]`` for every node of ``gm``.

    With ``real`` (and real tensors in ``example_inputs``, autocast off) the graph runs once on
    copies of the inputs (:func:`_real_propagation`): no meta function runs, so neither
    ``torch._dynamo`` nor sympy is imported, and each value's strides and device are what eager
    PyTorch gives. Otherwise real tensors in ``example_inputs`` stand in by their shape, dtype,
    strides and device only, and parameters and buffers of ``gm`` are only read for metadata: the
    graph runs on meta tensors (:class:`_MetaPropagation`), or with fake tensors on their real
    devices when ``torch.autocast`` is on (autocast casts per device type, and meta tensors have
    none) or an input is already a ``FakeTensor`` (Dynamo passes them).
    """
    fake_inputs = any(isinstance(a, torch.Tensor) and hasattr(a, "fake_mode") for a in example_inputs)
    device = next((a.device for a in example_inputs if isinstance(a, torch.Tensor)), None)
    autocast = device is not None and device.type in ("cuda", "cpu") and torch.is_autocast_enabled(
        device.type)
    if fake_inputs or autocast:
        _fake_propagation(gm, example_inputs)
    elif real:
        _real_propagation(gm, example_inputs)
    else:
        _MetaPropagation(gm, device).run(*example_inputs)
    return gm


def _real_propagation(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Run ``gm`` on clones of ``example_inputs`` under ``no_grad`` and record each node's value
    as a meta tensor of the same shape, dtype and strides, and its device.

    The run leaves no trace: tensor inputs are cloned (an in-place op cannot change the caller's),
    random ops draw nothing (:class:`~.random_ops.NoDraws` around each node that
    :func:`~.random_ops.may_draw`), and the module state the graph may write is read from clones
    (:class:`_PrivateState`).
    """
    with torch.no_grad():
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs]
        private = _PrivateState(written_state(gm), _detached_clone)
        _RecordingInterpreter(gm, private).run(*inputs)


def written_state(gm: fx.GraphModule) -> list[torch.Tensor]:
    """What a run of ``gm`` may write of the module's state: its buffers, and its parameters too
    where the graph writes in place (an optimizer's step, a forward's update)."""
    writes = any(writes_in_place(n) or n.target is write_back for n in gm.graph.nodes)
    return [*gm.buffers(), *(gm.parameters() if writes else ())]


def _detached_clone(t: torch.Tensor) -> torch.Tensor:
    clone = t.detach().clone()
    if t.grad is not None:  # code that reads a parameter's gradient reads the same one
        clone.grad = t.grad
    return clone


class _PrivateState:
    """Copies of module tensors for a run that may write them: ``tensors`` mapped by ``make``
    (a clone, a fake tensor), and :meth:`swap` for ``fx.Interpreter.fetch_attr``'s result: a
    tensor's copy, or a shallow copy of a module whose parameters and buffers (its submodules',
    recursively) are the copies where there are copies."""

    def __init__(self, tensors: Sequence[torch.Tensor],
                 make: Callable[[torch.Tensor], torch.Tensor]):
        self.copies = {id(t): make(t) for t in tensors}
        self._keep = tensors  # the ids above stay those of these objects

    def swap(self, value: Any) -> Any:
        if not self.copies:
            return value
        if isinstance(value, torch.Tensor):
            return self.copies.get(id(value), value)
        if isinstance(value, torch.nn.Module):
            return self._module(value)
        return value

    def _module(self, module: torch.nn.Module) -> torch.nn.Module:
        state = itertools.chain(module.parameters(), module.buffers())
        if not any(id(t) in self.copies for t in state):
            return module
        return shallow_module(module, lambda t: self.copies.get(id(t), t), self._module)


class _HooksLeft:
    """An interpreter mixin: a tensor hook's registration (``y.register_hook(f)``, Dynamo's
    ``higher_order.register_hook``, ``retain_grad``) is not run, its tensor passed on. A
    propagation runs on tensors that need no gradient, on which registering one raises ("cannot
    register a hook on a tensor that doesn't require gradient"): the model seemed not to take
    its inputs. The graph keeps the node; the calls register the hook."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if registers_tensor_hook("call_function", target):  # (the higher-order op)
            return args[0]
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if registers_tensor_hook("call_method", target):
            return None
        return super().call_method(target, args, kwargs)


class _SharingRecorded:
    """An interpreter mixin: ``meta["shares"]`` on each node, the argument its value shares
    memory with (:func:`~.ir.aliasing.shared_input`), read by the view analysis of
    :mod:`~.ir.aliasing`."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        names = shared_input(n, result, self.env)
        if len(names) < 2:
            n.meta["shares"] = names[0] if names else None
        else:  # (which item views which argument is not recorded: the tables answer)
            n.meta.pop("shares", None)
        return result


def _as_meta(value: Any) -> Any:
    """``value`` with its tensors as meta tensors (:func:`~.ir.ops.meta_like`), its containers
    and ``torch.Size`` s kept as they are: pytree's map rebuilds a ``torch.Size`` as a plain
    tuple (torch 2.11 and 2.13), and an output put back from the recorded value
    (:func:`~.glue_compile.inductor_compile`) was then no ``torch.Size``."""
    if isinstance(value, torch.Size) or not isinstance(value, (tuple, list, dict)):
        return meta_like(value)
    if isinstance(value, dict):
        return {k: _as_meta(v) for k, v in value.items()}
    items = [_as_meta(v) for v in value]
    if isinstance(value, list) or type(value) is tuple:
        return type(value)(items)
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


class _RecordingInterpreter(_SharingRecorded, _HooksLeft, fx.Interpreter):
    """Run a graph on real tensors, ``private``'s copies in place of the module's; record each
    node's value as meta tensors and its device."""

    def __init__(self, gm: fx.GraphModule, private: _PrivateState):
        super().__init__(gm)
        self.private = private

    def fetch_attr(self, target: str) -> Any:
        return self.private.swap(super().fetch_attr(target))

    def run_node(self, n: fx.Node) -> Any:
        if may_draw(n, self.module):
            with NoDraws():
                result = super().run_node(n)
        else:
            result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            n.meta["device"] = result.device
        n.meta["val"] = _as_meta(result)
        return result


def _fake_propagation(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """``FakeTensorProp`` over ``gm``: fake tensors keep their real device, so device-dependent
    dispatch (autocast) is what it will be at run time."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 (imports torch._dynamo)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp  # noqa: PLC0415

    mode = next((a.fake_mode for a in example_inputs
                 if isinstance(a, torch.Tensor) and hasattr(a, "fake_mode")), None)
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        mode.allow_non_fake_inputs = True
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and not hasattr(a, "fake_mode") else a
            for a in example_inputs]

    private = _PrivateState(written_state(gm), lambda t: _fake_copy(mode, t))

    class _KeepingNumbers(_SharingRecorded, _HooksLeft, FakeTensorProp):
        """Also records shape arithmetic (``x.shape``, its items, ``h // 4``): torch 2.11's
        ``FakeTensorProp`` keeps only tensors and symbolic numbers, which left such nodes
        without a value and their users unspecialized. The module state the graph may write
        is read as fake tensors (the fake mode lets real tensors in, and would write them)."""

        def fetch_attr(self, target: str) -> Any:
            return private.swap(super().fetch_attr(target))

        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if _plain_number(result):
                n.meta["val"] = result
            return result

    try:
        with mode:
            _KeepingNumbers(gm, mode).propagate(*fake)
    finally:
        # Under torch.autocast, casts of parameters are cached for the rest of the autocast
        # region; the ones made here are fake and must not be reused by the real run.
        torch.clear_autocast_cache()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["device"] = val.device


def _fake_copy(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake tensor for module state ``t`` that the graph may write; a single number stays known
    (a constant of the fake mode, over a clone of ``t``): batch norm's ``momentum=None`` average
    reads ``float(num_batches_tracked)``, which a fake tensor without a value cannot give."""
    if t.numel() > 1:
        return mode.from_tensor(t)
    return mode.fake_tensor_converter.from_real_tensor(mode, t.detach().clone(),
                                                       make_constant=True)


def _plain_number(value: Any) -> bool:
    """Whether ``value`` is a Python number or a size/tuple of them (no tensor, no symbol)."""
    if isinstance(value, (tuple, list)):
        return all(_plain_number(v) for v in value)
    return isinstance(value, (int, float, bool))


class _MetaPropagation(_SharingRecorded, _HooksLeft, fx.Interpreter):
    """Run a graph on meta tensors and record each node's value and device.

    The device of a node's value is that of its first tensor argument (a placeholder's: its
    input's; a ``get_attr``'s: the parameter's); a node without tensor arguments gets the graph's
    device (the first input's). Module calls run on a copy of the module that holds meta copies
    of its parameters and buffers (the module itself is left as it is).
    """

    def __init__(self, gm: fx.GraphModule, device: torch.device | None):
        super().__init__(gm)
        self.device = device
        self.devices: dict[fx.Node, torch.device] = {}
        self.node: fx.Node | None = None  # the node being run

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        with torch.no_grad():
            result = super().run_node(n)
        device = self.devices.get(n)
        if device is None:
            device = next((self.devices[a] for a in n.all_input_nodes if a in self.devices),
                          self.device)
        if isinstance(result, torch.Tensor) and device is not None:
            self.devices[n] = device
            n.meta["device"] = device
        n.meta["val"] = result
        return result

    def placeholder(self, target, args, kwargs):
        value = super().placeholder(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            self.devices[self.node] = value.device
        return meta_like(value)

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            self.devices[self.node] = value.device
        return meta_like(value)

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        state = [*module.parameters(), *module.buffers()]
        if not state:
            return module(*args, **kwargs)
        first = next(iter(module.parameters()), None)
        if first is not None and self.node not in self.devices and not any(
                a in self.devices for a in self.node.all_input_nodes):
            self.devices[self.node] = first.device
        return _PrivateState(state, meta_like).swap(module)(*args, **kwargs)


_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                torch.bool, torch.complex64, torch.complex128)}


def _encode(value: Any) -> Any:
    """JSON-ready form of a ``meta["val"]`` (tensors by shape, strides, dtype); raises
    ``TypeError`` for what it does not know."""
    if isinstance(value, torch.Tensor):
        if str(value.dtype) not in _DTYPES:
            raise TypeError(value.dtype)
        return {"tensor": [list(value.shape), list(value.stride()), str(value.dtype)]}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, (tuple, list)):
        return {type(value).__name__: [_encode(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(type(value).__name__)


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, data), = value.items()
    if kind == "tensor":
        shape, stride, dtype = data
        return torch.empty_strided(shape, stride, dtype=_DTYPES[dtype], device="meta")
    if kind == "size":
        return torch.Size(data)
    if kind == "dtype":
        return _DTYPES[data]
    items = [_decode(v) for v in data]
    return tuple(items) if kind == "tuple" else items


def _target_name(target: Any) -> str:
    """A name of a node's target that is the same in every process (no object address)."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{module}.{name}" if name else type(target).__name__


def encode_meta(gm: fx.GraphModule) -> dict | None:
    """The metadata :func:`propagate_shapes` recorded on ``gm``'s nodes, as JSON-ready data
    ``{node name: [op, target, value, device, shares]}``; ``None`` when a value has no such
    form."""
    table = {}
    for node in gm.graph.nodes:
        if "val" not in node.meta:
            continue
        device = node.meta.get("device")
        try:
            value = _encode(node.meta["val"])
        except TypeError:
            return None
        table[node.name] = [node.op, _target_name(node.target), value,
                            None if device is None else str(device), node.meta.get("shares")]
    return table


def apply_meta(gm: fx.GraphModule, table: dict) -> bool:
    """Set ``meta["val"]``, ``meta["device"]`` and ``meta["shares"]`` of ``gm``'s nodes from
    :func:`encode_meta`'s ``table``, recorded for the same graph; ``False`` (and ``gm``
    unchanged) when a node is not in it under the same op and target. Values become meta
    tensors: no op runs."""
    decoded = {}
    for node in gm.graph.nodes:
        entry = table.get(node.name)
        if entry is None:
            if node.op == "output":
                continue
            return False
        op, target, value, device, *shares = entry  # (shares: since session 52)
        if op != node.op or target != _target_name(node.target):
            return False
        decoded[node] = (_decode(value), None if device is None else torch.device(device),
                         shares)
    for node, (value, device, shares) in decoded.items():
        node.meta["val"] = value
        if shares:
            node.meta["shares"] = shares[0]
        if device is not None:
            node.meta["device"] = device
    return True
