"""Capture: an ``nn.Module`` becomes a ``torch.fx.GraphModule`` with tensor metadata on its nodes.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map_only

from .ir.errors import FusionError, InputTypeError
from .ir.ops import copy_graph, write_back, writes_in_place
from .runtime.background import on_calling_thread, warn_once
from .runtime.state import ModuleWrites, note_reads
from .runtime.tensors import restored
from .tracing import ModeRecordingTracer, mark_grad_modes, recording_reads

__all__ = ["TensorSpec", "capture", "propagate_shapes", "input_specs", "encode_meta", "apply_meta"]


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
    tuple of tensors by itself: each new tuple compiles again, with one WARNING).

    Raises:
        InputTypeError: a list, dict or set input (it may change between calls unseen)."""
    for i, a in enumerate(args):
        if isinstance(a, (list, dict, set)):
            raise InputTypeError(f"input {i} is a {type(a).__name__}: compiled graphs take "
                                 "tensors, numbers and tuples (pass the tensors as arguments)")
        if isinstance(a, tuple) and any(isinstance(t, torch.Tensor) for t in a):
            warn_once("reusing a specialization", f"input {i} is a tuple of tensors, keyed by the "
                      "tuple itself: each new tuple compiles again (pass its tensors as arguments)")
    return tuple(TensorSpec.of(a) if isinstance(a, torch.Tensor) else a for a in args)


def capture(model: torch.nn.Module, none: Sequence[str] = ()) -> fx.GraphModule:
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
    writes them.

    Raises:
        FusionError: the model's ``forward`` is not symbolically traceable (data-dependent
            control flow, for instance; the message carries fx's own error), or assigns to
            the model (``self.count += 1``; the model is left as it was). A
            ``DistributedDataParallel`` module gets a message naming the fix.
    """
    if isinstance(model, fx.GraphModule):
        return fx.GraphModule(model, copy_graph(model.graph))
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise FusionError(
            "fusion_compiler.compile got a DistributedDataParallel module: compile the model "
            "inside it and wrap the result, DDP(fusion_compiler.compile(model)), so DDP still "
            "all-reduces the gradients (or use torch.compile(DDP(model), "
            "backend='fusion_compiler'))")
    on_calling_thread("torch.fx tracing")
    tracer = ModeRecordingTracer()
    writes = ModuleWrites(model)  # the trace runs forward's Python code: the model is put back
    try:
        with torch.enable_grad(), recording_reads(model) as reads:
            graph = tracer.trace(model, concrete_args={name: None for name in none} or None)
        note_reads(reads)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        writes.restore()
        raise FusionError(
            f"torch.fx.symbolic_trace failed for {type(model).__name__}: {exc}. "
            "Use torch.compile(model, backend='fusion_compiler') for code fx cannot trace "
            "(data-dependent control flow, item assignment, NumPy values)."
        ) from exc
    assigned = writes.restore()
    if assigned:
        raise FusionError(
            f"{type(model).__name__}.forward assigns {', '.join(assigned)} on the module: a "
            "compiled graph cannot repeat an assignment at each call (an in-place update of a "
            "buffer it can: self.n.add_(1)); move it out of forward, or use "
            "torch.compile(model, backend='fusion_compiler'), whose graphs Dynamo guards")
    mark_grad_modes(gm)
    return gm


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
    the random number generators of the CPU and the inputs' GPU are forked (dropout draws), and
    buffers are :func:`restored` (batch norm in training mode updates its running statistics), and
    parameters where the graph writes in place.
    """
    devices = sorted({a.get_device() for a in example_inputs
                      if isinstance(a, torch.Tensor) and a.is_cuda})
    with torch.no_grad(), restored(_written_state(gm)), torch.random.fork_rng(devices=devices):
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs]
        _RecordingInterpreter(gm).run(*inputs)


def _written_state(gm: fx.GraphModule) -> list[torch.Tensor]:
    """What a run of ``gm`` may write of the module's state: its buffers, and its parameters too
    where the graph writes in place (an optimizer's step, a forward's update)."""
    writes = any(writes_in_place(n) or n.target is write_back for n in gm.graph.nodes)
    return [*gm.buffers(), *(gm.parameters() if writes else ())]


class _RecordingInterpreter(fx.Interpreter):
    """Run a graph on real tensors; record each node's value as meta tensors and its device."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            n.meta["device"] = result.device
        n.meta["val"] = tree_map_only(torch.Tensor, _to_meta, result)
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

    class _KeepingNumbers(FakeTensorProp):
        """Also records shape arithmetic (``x.shape``, its items, ``h // 4``): torch 2.11's
        ``FakeTensorProp`` keeps only tensors and symbolic numbers, which left such nodes
        without a value and their users unspecialized."""

        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            if _plain_number(result):
                n.meta["val"] = result
            return result

    try:  # real tensors (the module's state) are written in place in the fake mode: restored
        with restored(_written_state(gm)), mode:
            _KeepingNumbers(gm, mode).propagate(*fake)
    finally:
        # Under torch.autocast, casts of parameters are cached for the rest of the autocast
        # region; the ones made here are fake and must not be reused by the real run.
        torch.clear_autocast_cache()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["device"] = val.device


def _plain_number(value: Any) -> bool:
    """Whether ``value`` is a Python number or a size/tuple of them (no tensor, no symbol)."""
    if isinstance(value, (tuple, list)):
        return all(_plain_number(v) for v in value)
    return isinstance(value, (int, float, bool))


def _to_meta(value: Any) -> Any:
    """A meta tensor with ``value``'s shape, dtype and strides (other values unchanged)."""
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class _MetaPropagation(fx.Interpreter):
    """Run a graph on meta tensors and record each node's value and device.

    The device of a node's value is that of its first tensor argument (a placeholder's: its
    input's; a ``get_attr``'s: the parameter's); a node without tensor arguments gets the graph's
    device (the first input's). Module calls run with their parameters swapped for meta copies
    (``torch.func.functional_call``).
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
        return _to_meta(value)

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor):
            self.devices[self.node] = value.device
        return _to_meta(value)

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        state = {name: _to_meta(t) for name, t in (*module.named_parameters(),
                                                    *module.named_buffers())}
        if not state:
            return module(*args, **kwargs)
        first = next(iter(module.parameters()), None)
        if first is not None and self.node not in self.devices and not any(
                a in self.devices for a in self.node.all_input_nodes):
            self.devices[self.node] = first.device
        return torch.func.functional_call(module, state, args, kwargs, strict=False)


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
    ``{node name: [op, target, value, device]}``; ``None`` when a value has no such form."""
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
                            None if device is None else str(device)]
    return table


def apply_meta(gm: fx.GraphModule, table: dict) -> bool:
    """Set ``meta["val"]`` and ``meta["device"]`` of ``gm``'s nodes from :func:`encode_meta`'s
    ``table``, recorded for the same graph; ``False`` (and ``gm`` unchanged) when a node is not
    in it under the same op and target. Values become meta tensors: no op runs."""
    decoded = {}
    for node in gm.graph.nodes:
        entry = table.get(node.name)
        if entry is None:
            if node.op == "output":
                continue
            return False
        op, target, value, device = entry
        if op != node.op or target != _target_name(node.target):
            return False
        decoded[node] = (_decode(value), None if device is None else torch.device(device))
    for node, (value, device) in decoded.items():
        node.meta["val"] = value
        if device is not None:
            node.meta["device"] = device
    return True
