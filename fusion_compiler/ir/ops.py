"""The canonical operator set that the passes produce and the backends consume.

After :func:`fusion_compiler.passes.pre_fusion.normalize.normalize` a graph uses only these
targets for the operations a region may contain (everything else stays as the model wrote it):

======================  ==========================================================  ===========
target                  form                                                        cuDNN op
======================  ==========================================================  ===========
``torch.conv2d``        ``conv2d(x, w, None, stride, padding, dilation, groups)``    conv_fprop
``torch.add`` etc.      ``add(a, b)``, ``sub``, ``mul``, ``div`` (no ``alpha``)      pointwise
``torch.relu``          ``relu(x)``                                                 relu
``torch.clamp``         ``clamp(x, lo, hi)`` (``lo == 0``: clipped ReLU)            relu(clips)
``torch.sigmoid``       ``sigmoid(x)``, ``tanh(x)``                                 pointwise
``F.silu``              ``silu(x)`` (``x * sigmoid(x)``)                            swish
``torch.sum``           ``sum(x, [2, 3], keepdim=True)`` (sum over H, W)            reduction
======================  ==========================================================  ===========

Tensors are NCHW in the graph (the logical layout); backends choose the physical one.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

CONV = torch.conv2d


def int_pair(v: Any) -> tuple[int, int] | None:
    """A convolution's stride, padding or dilation argument as ``(height, width)`` integers: an
    int for both, or a pair of ints; ``None`` for anything else (a string padding, a symbol)."""
    if isinstance(v, int):
        return v, v
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(i, int) for i in v):
        return int(v[0]), int(v[1])
    return None


def write_back(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``target.copy_(value)``: how a graph whose in-place ops were made out of place leaves a
    graph input or a module buffer it wrote updated, as eager PyTorch does. A side effect: never
    removed as dead code (``torch.fx`` is told so below)."""
    return target.copy_(value)


fx.node._side_effectful_functions.add(write_back)


def written_inputs(gm: fx.GraphModule) -> list[int]:
    """Positions of ``gm``'s inputs it writes in place (:func:`write_back` into a placeholder)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return [placeholders.index(n.args[0]) for n in gm.graph.find_nodes(
        op="call_function", target=write_back) if n.args[0] in placeholders]


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift}


INPLACE_POSITION = {F.relu: 1, F.relu6: 1, F.hardtanh: 3, F.elu: 2, F.leaky_relu: 2, F.silu: 1,
                    F.hardswish: 1, F.hardsigmoid: 1, F.mish: 1, F.selu: 1, F.celu: 2,
                    F.threshold: 3, F.rrelu: 4, F.dropout: 3, F.dropout1d: 3, F.dropout2d: 3,
                    F.dropout3d: 3, F.alpha_dropout: 3, F.feature_alpha_dropout: 3}
"""Functions whose positional argument at this index is ``inplace``."""


def inplace_flag(node: fx.Node) -> bool:
    """Whether ``node`` calls a function with ``inplace=True`` (by keyword or by position)."""
    position = INPLACE_POSITION.get(node.target)
    return node.kwargs.get("inplace") is True or (
        position is not None and len(node.args) > position and node.args[position] is True)


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into one of its arguments (``x.relu_()``, ``torch.relu_``,
    ``x += y``, ``F.relu(x, inplace=True)``, a module made with ``inplace=True``): a side
    effect, even with no reader of its value."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(node.target) if owner is not None else None
        return getattr(module, "inplace", False) is True
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    return (node.target in _IN_PLACE_OPERATORS or inplace_flag(node) or foreach_inplace(node)
            or (name.endswith("_") and not name.startswith("_")))


def foreach_inplace(node: fx.Node) -> bool:
    """Whether ``node`` is one of PyTorch's in-place multi-tensor ops (``torch._foreach_add_``:
    what optimizers and ``clip_grad_norm_`` call), which write into every tensor of their first
    argument, a list."""
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and name.startswith("_foreach_") and name.endswith("_")


def attribute(graph: fx.Graph, target: str) -> fx.Node:
    """A ``get_attr`` node of ``graph`` reading the module attribute ``target`` (a dotted path
    the caller found on the module). ``fx.Graph.get_attr`` warns when the attribute is a plain
    tensor, such as a parameter ``torch.func.functional_call`` swapped for a tensor, which a
    graph reads like any other."""
    return graph.create_node("get_attr", target)


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Remove the nodes of ``graph`` whose value nothing reads, keeping impure ones
    (``Node.is_impure``) and in-place writes (:func:`writes_in_place`), which torch.fx would drop
    when nothing reads their value. Not ``graph.eliminate_dead_code()``: torch 2.13's also
    eliminates in the graph modules of ``get_attr`` nodes (a checkpoint's body, shared with the
    graph it was copied from) with its own notion of purity, and dropped a batch norm's
    ``num_batches_tracked.add_(1)`` there."""
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure() and not writes_in_place(node):
            graph.erase_node(node)


BINARY = {torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "div"}
COMMUTATIVE = {torch.add, torch.mul}
UNARY = {torch.relu: "relu", torch.sigmoid: "sigmoid", torch.tanh: "tanh", torch.clamp: "clamp",
         F.silu: "silu"}
REDUCTION = torch.sum
HW_DIMS = [2, 3]


def is_call(node: object, *targets) -> bool:
    """True when ``node`` is an fx ``call_function`` node with one of ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def calls_named(node: object, name: str) -> bool:
    """True when ``node`` is an fx ``call_function`` node of a function or op named ``name``
    (for Dynamo's higher-order ops, such as ``tag_activation_checkpoint``, which a torch version
    may not export under one path)."""
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and getattr(node.target, "__name__", "") == name)


def is_conv(node: object) -> bool:
    return is_call(node, CONV)


def dtype_cast(node: object) -> torch.dtype | None:
    """The dtype when ``node`` is ``x.to(dtype)`` (no device, no other argument; the autocast
    pass writes these), else ``None``."""
    if (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "to"
            and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs):
        return node.args[1]
    return None


def is_pointwise(node: object) -> bool:
    return is_call(node, *BINARY, *UNARY)


def is_hw_sum(node: object) -> bool:
    """A ``sum(x, [2, 3], keepdim=True)`` node (the only reduction a region may end with)."""
    return (is_call(node, REDUCTION) and len(node.args) >= 2 and list(node.args[1]) == HW_DIMS
            and bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)))


def op_name(node: fx.Node) -> str:
    """Short name of a canonical op, e.g. ``add``, ``relu``, ``conv3x3``, ``sum_hw``."""
    if is_conv(node):
        w = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        kernel = f"{w.shape[2]}x{w.shape[3]}" if w is not None else ""
        stride = tuple(node.args[3])
        return f"conv{kernel}" + (f"/s{stride[0]}" if stride != (1, 1) else "")
    if is_hw_sum(node):
        return "sum_hw"
    if node.op == "call_function":
        return BINARY.get(node.target) or UNARY.get(node.target) or getattr(node.target, "__name__", str(node.target))
    return str(node.target)


_AVG_POOL2D_DEFAULTS = {"stride": None, "padding": 0, "ceil_mode": False,
                        "count_include_pad": True, "divisor_override": None}


def avg_pool2d_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of an ``F.avg_pool2d`` call node by name (``input``, ``kernel_size``,
    ``stride``, ``padding``, ``ceil_mode``, ``count_include_pad``, ``divisor_override``),
    positional or keyword, with ``F.avg_pool2d``'s defaults for those not given."""
    names = ["input", "kernel_size", *_AVG_POOL2D_DEFAULTS]
    return _AVG_POOL2D_DEFAULTS | dict(zip(names, node.args)) | dict(node.kwargs)


def conv_flops(node: fx.Node, gm: fx.GraphModule) -> int | None:
    """Multiply-adds x 2 of one convolution node, from its traced shapes:
    ``2 * numel(output) * (C_in / groups) * kh * kw`` (``weight.shape[1:]`` of an
    ``[K, C/groups, kh, kw]`` weight); ``None`` when the shapes are not known."""
    out = node.meta.get("val")
    if node.op == "call_module":
        weight = getattr(gm.get_submodule(node.target), "weight", None)
    else:
        arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        weight = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return None
    return 2 * out.numel() * weight[0].numel()


CONVOLUTIONS = (torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d,
                torch.conv_transpose2d, torch.conv_transpose3d, F.conv1d, F.conv2d, F.conv3d)
"""Every convolution function of PyTorch (regions take 2-d ones; the others stay PyTorch ops)."""


def is_any_conv(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` of ``gm`` is a convolution of any kind: a call of :data:`CONVOLUTIONS`
    or of a ``torch.nn`` convolution module."""
    return is_call(node, *CONVOLUTIONS) or (node.op == "call_module" and isinstance(
        gm.get_submodule(node.target), torch.nn.modules.conv._ConvNd))


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph``: new nodes with the same ops, targets and metadata, and the same
    code generator settings (the pytree specs of its inputs and outputs). Passes that rewrite the
    copy leave ``graph`` as it was."""
    copied = fx.Graph()
    copied.output(copied.graph_copy(graph, {}))
    copied._codegen = copy.deepcopy(graph._codegen)
    return copied


def node_device(node: fx.Node) -> torch.device:
    """The device ``node``'s value lives on when the graph runs (set by
    :func:`fusion_compiler.shapes.propagate_shapes`; ``meta["val"]`` itself may be a meta
    tensor)."""
    device = node.meta.get("device")
    if device is not None:
        return device
    return node.meta["val"].device


def tensor_meta(node: fx.Node) -> torch.Tensor | None:
    """The meta or fake tensor recorded on ``node`` by
    :func:`fusion_compiler.shapes.propagate_shapes`, or ``None``."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def tensor_shape(node: object) -> tuple[int, ...] | None:
    """The shape of :func:`tensor_meta`'s tensor, or ``None``."""
    val = tensor_meta(node)
    return tuple(val.shape) if val is not None else None


def meta_like(value: Any) -> Any:
    """A meta tensor with ``value``'s shape, dtype and strides (other values, and meta tensors,
    unchanged)."""
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def shallow_module(module: torch.nn.Module,
                   tensor: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                   child: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m
                   ) -> torch.nn.Module:
    """A shallow copy of ``module`` with tables of its own: parameters and buffers mapped by
    ``tensor``, submodules by ``child`` (the same objects by default), the other attributes
    shared. Not ``copy.copy``, which a parametrized module refuses ("Serialization of
    parametrized modules is only supported through state_dict()", ``torch.nn.utils.
    parametrize``): the copy is a new object of the module's class with a new ``__dict__``."""
    clone = object.__new__(type(module))
    clone.__dict__.update(vars(module))
    for table in ("_parameters", "_buffers"):
        object.__setattr__(clone, table, {name: None if t is None else tensor(t)
                                          for name, t in getattr(module, table).items()})
    object.__setattr__(clone, "_modules", {name: None if m is None else child(m)
                                           for name, m in module._modules.items()})
    return clone


def mark_grad_zones(graph: fx.Graph) -> None:
    """``meta["grad_zone"]`` on every node of ``graph``: how many ``torch._C._set_grad_enabled``
    calls (a ``torch.no_grad`` block in the code, as Dynamo or the capture writes it) come
    before it. Fused across a change of mode, an op would run in the other one (its gradients
    lost, or computed where eager computes none): the passes that merge nodes (CSE, the fuse
    pass) mark the zones when they start, so that nodes the passes before inserted (the batch
    norm fold's scale and shift, inserted where the batch norm was) have theirs."""
    zone = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            zone += 1
        node.meta["grad_zone"] = zone


def enables_grad(graph: fx.Graph) -> bool:
    """Whether ``graph`` turns gradients on in a block (``torch._C._set_grad_enabled(True)``,
    as Dynamo and :func:`~fusion_compiler.grad_modes.mark_grad_modes` write a
    ``torch.enable_grad`` block): called without gradients, it still records some."""
    return any(node.op == "call_function" and node.target is torch._C._set_grad_enabled
               and node.args[:1] == (True,) for node in graph.nodes)


def grad_mode_at_end(graph: fx.Graph) -> bool | None:
    """The gradient mode ``graph`` leaves set: the argument of its last
    ``torch._C._set_grad_enabled`` call (Dynamo writes a bare ``torch.set_grad_enabled(False)``
    as one, and a block's exit as another, with the modes of the caller it guards on), ``None``
    when it has none (or its argument is not a constant)."""
    last = None
    for node in graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled):
        last = node.args[0] if isinstance(node.args[0], bool) else None
    return last


TENSOR_HOOKS = frozenset({"register_hook", "retain_grad", "register_post_accumulate_grad_hook"})
"""Tensor methods that register a hook on the tensor (autograd calls it in the backward)."""


def registers_tensor_hook(op: str, target: Any) -> bool:
    """Whether a node (``op``, ``target``) registers a tensor hook: one of :data:`TENSOR_HOOKS`
    as a method, or Dynamo's ``torch.ops.higher_order.register_hook`` (known by its name:
    Dynamo makes it when it first traces a hook)."""
    if op == "call_method":
        return target in TENSOR_HOOKS
    return op == "call_function" and getattr(target, "__name__", "") == "register_hook"
