"""Which values of a traced graph may share memory: the in-place ops (what each writes, and its
out-of-place twin), the ops that may return a view of their argument (or the argument itself),
and the ops whose result always has memory of its own. The rewrite of in-place ops
(``passes/pre_fusion/functionalize``), the capture's check of writes into traced constants and
of constants returned (``capture``), and hoisting (``passes/post_lowering/hoist``) read it. The
tables are PyTorch's documented view ops ("Tensor Views" in PyTorch's documentation) and the
ops this package rewrites. Where a shape propagation ran, what it saw answers instead
(``meta["shares"]``, :func:`shared_input`: the argument a value shares storage with), so a view
op missing from the tables is still seen. Without that record, an op in none of the tables is
taken to make memory of its own where a view is asked about (:func:`may_be_view`) and to
possibly share it where fresh memory is (:func:`fresh`)."""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .ops import inplace_flag, writes_in_place

__all__ = ["inplace_target", "alias_source", "may_be_view", "written_source", "fresh",
           "is_torchvision_stochastic_depth", "view_chain", "view_base", "tensor_result",
           "shared_input", "written_attribute", "written_attributes", "called_module"]

# in-place target -> out-of-place canonical target (call_function and call_method spellings)
_INPLACE_FUNCS = {operator.iadd: torch.add, operator.isub: torch.sub, operator.imul: torch.mul,
                  operator.itruediv: torch.div, torch.relu_: torch.relu, F.relu_: torch.relu}
_AUGMENTED = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def inplace_target(gm: fx.GraphModule, node: fx.Node) -> Callable | str | None:
    """The out-of-place target for an in-place ``node`` (a function, a method name or the module
    path), or ``None`` if ``node`` does not write into its first argument."""
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCS:  # x += y on a number (shape arithmetic) writes nothing
            value = node.args[0].meta.get("val") if node.args and isinstance(
                node.args[0], fx.Node) else None
            numeric = value is not None and not isinstance(value, torch.Tensor)
            return None if numeric and node.target in _AUGMENTED else _INPLACE_FUNCS[node.target]
        if inplace_flag(node):
            return node.target
    elif node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.target[:-1]
    elif node.op == "call_module":
        if getattr(called_module(gm, node), "inplace", False) is True:
            return node.target
    return None


def called_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module:
    """The module a ``call_module`` node runs: the submodule, or the module a wrapper runs in
    its place (its ``wraps``: a parametrized module's call that computes the parametrized
    tensors itself)."""
    module = gm.get_submodule(node.target)
    return getattr(module, "wraps", module)


_VIEW_METHODS = {"view", "reshape", "expand", "expand_as", "view_as", "reshape_as", "permute",
                 "transpose", "t", "squeeze", "unsqueeze", "flatten", "unflatten", "narrow",
                 "select", "as_strided", "detach", "split", "chunk", "unbind", "diagonal",
                 "movedim", "moveaxis", "unfold", "__getitem__", "ravel", "swapaxes", "swapdims",
                 "view_as_real", "tensor_split", "split_with_sizes", "hsplit", "vsplit",
                 "dsplit", "broadcast_to", "conj", "adjoint", "positive", "resolve_conj",
                 "resolve_neg"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze,
                   torch.permute, torch.transpose, torch.t, torch.narrow, torch.select,
                   torch.split, torch.split_with_sizes, torch.tensor_split, torch.hsplit,
                   torch.vsplit, torch.dsplit, torch.chunk, torch.unbind, torch.as_strided,
                   torch.movedim, torch.moveaxis, torch.diagonal, torch.detach, torch.ravel,
                   torch.swapaxes, torch.swapdims, torch.view_as_real, torch.view_as_complex,
                   torch.einsum, torch.unflatten, torch.atleast_1d, torch.atleast_2d,
                   torch.atleast_3d, torch.broadcast_to, torch.real, torch.imag, torch.conj,
                   torch.adjoint, torch.positive, torch.resolve_conj, torch.resolve_neg,
                   # dropout returns its input itself in eval mode
                   torch.dropout, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
                   F.alpha_dropout, F.feature_alpha_dropout}
_TENSOR_ATTRIBUTES = {"T", "mT", "H", "mH", "data", "real", "imag"}
"""Tensor attributes that are views (``x.shape`` and the like are not: no memory)."""


_SELF_METHODS = {"contiguous", "float", "half", "double", "bfloat16", "to", "type", "type_as",
                 "cpu", "cuda"}
"""Methods that may return their argument itself (``x.float()`` of an fp32 ``x``)."""
_ALIASING_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)
"""``torch.nn`` modules that may return their input or a view of it (dropout in eval mode)."""
_FRESH_MODULES = (nn.modules.conv._ConvNd, nn.Linear, nn.modules.pooling._MaxPoolNd,
                  nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
                  nn.modules.pooling._AdaptiveMaxPoolNd, nn.modules.batchnorm._BatchNorm,
                  nn.GroupNorm, nn.LayerNorm, nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Hardswish,
                  nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.Mish, nn.ELU, nn.Upsample,
                  nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm, nn.Hardtanh,
                  nn.PReLU, nn.SELU, nn.CELU, nn.Softplus, nn.Softmax, nn.LogSoftmax, nn.GLU,
                  nn.Bilinear)
_FRESH_FUNCTIONS = {torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d,
                    torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
                    F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.linear,
                    F.batch_norm, torch.batch_norm, F.layer_norm, torch.layer_norm, F.group_norm,
                    torch.group_norm, F.instance_norm, F.local_response_norm, F.normalize,
                    torch.add, torch.sub, torch.mul, torch.div, operator.add, operator.sub,
                    operator.mul, operator.truediv, torch.cat, torch.stack, torch.mean,
                    torch.sum, torch.amax, torch.clamp, torch.where, torch.exp, torch.sqrt,
                    torch.rsqrt, torch.pow, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
                    F.adaptive_avg_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
                    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool2d, torch.relu,
                    torch.sigmoid, torch.tanh, F.relu, F.relu6, F.silu, F.gelu, F.hardswish,
                    F.hardsigmoid, F.hardtanh, F.leaky_relu, F.elu, F.selu, F.celu, F.mish,
                    F.softplus, F.sigmoid, F.tanh, F.softmax, F.log_softmax, torch.softmax,
                    F.interpolate, F.pixel_shuffle, F.pixel_unshuffle, torch.matmul, torch.mm,
                    torch.bmm, operator.matmul}
_FRESH_METHODS = {"add", "sub", "mul", "div", "mean", "sum", "clone", "relu", "sigmoid", "tanh",
                  "matmul", "softmax", "log_softmax", "exp", "sqrt", "rsqrt", "pow", "clamp",
                  "amax", "bmm", "mm"}
"""Ops whose result always has memory of its own (module types, functions, methods), unless
made in place (``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``)."""


def alias_source(node: object) -> fx.Node | None:
    """The value ``node``'s result may share memory with: the argument a shape propagation saw
    it share memory with (``meta["shares"]``, :func:`shared_input`), else its first tensor
    argument (``a`` of ``torch.einsum("ij->ji", a)``), or ``input=``."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method",
                                                        "call_module"):
        return None
    seen = node.meta.get("shares")
    if seen is not None:
        found = next((a for a in node.all_input_nodes if a.name == seen), None)
        if found is not None:
            return found
    if node.target in _ATLEAST and len(node.args) > 1:
        return None  # (torch.atleast_3d(a, b): which item views which is not known here)
    first = next((a for a in node.args if isinstance(a, fx.Node)),
                 node.kwargs.get("input", node.kwargs.get("self")))
    return first if isinstance(first, fx.Node) else None


def may_be_view(node: object) -> bool:
    """Whether ``node`` may return a view of its source without being an in-place op: a view
    op, a method that may return its argument itself, ``getattr`` (``x.T``, ``x.data``), a
    function that may (dropout; torchvision's ``stochastic_depth`` in eval mode), or a module
    that may return its input (``nn.Flatten``, dropout). Where a shape propagation recorded
    whether the value shares memory with an argument (``meta["shares"]``: the specialization's
    shapes and strides are fixed), that answers, whatever the op: a view op missing from the
    tables is still seen (its write was lost), a reshape that copies is no view."""
    if alias_source(node) is None:
        return False
    owner = node.graph.owning_module
    if "shares" in node.meta and owner is not None and inplace_target(owner, node) is None:
        return node.meta["shares"] is not None
    if node.op == "call_method":
        if node.target in _SELF_METHODS:  # a cast to another dtype or device: new memory
            new, old = node.meta.get("val"), alias_source(node).meta.get("val")
            return not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
                        and (new.dtype != old.dtype or new.device != old.device))
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS or is_torchvision_stochastic_depth(node.target) or (
            node.target is getattr and len(node.args) > 1 and node.args[1] in _TENSOR_ATTRIBUTES)
    return owner is not None and isinstance(called_module(owner, node), _ALIASING_MODULES)


def written_source(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The value an in-place ``node`` writes (its result is that value), else ``None``."""
    return alias_source(node) if inplace_target(gm, node) is not None else None


def fresh(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s result certainly has memory no other value shares (a convolution's, a
    sum's, a pooling's output)."""
    if node.op == "call_module":
        module = called_module(gm, node)
        return isinstance(module, _FRESH_MODULES) and getattr(module, "inplace", False) is not True
    if node.kwargs.get("out") is not None or inplace_target(gm, node) is not None:
        return False
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    return node.op == "call_method" and node.target in _FRESH_METHODS


def is_torchvision_stochastic_depth(target: Any) -> bool:
    """Whether ``target`` is ``torchvision.ops.stochastic_depth(input, p, mode, training=True)``,
    which returns ``input`` itself when ``not training or p == 0.0`` (torchvision is not
    imported here: the function is known by where it is defined)."""
    return (getattr(target, "__module__", None) == "torchvision.ops.stochastic_depth"
            and getattr(target, "__name__", None) == "stochastic_depth")


def view_chain(gm: fx.GraphModule | None, node: object) -> list[object]:
    """``node``, and the values it may share memory with through views and in-place ops, down
    to the one whose memory it may be (the last); ``[node]`` when it is neither. Without
    ``gm``, in-place modules are not followed."""
    chain = [node]
    while isinstance(node, fx.Node) and (
            may_be_view(node) or gm is not None and written_source(gm, node) is not None):
        node = alias_source(node)
        chain.append(node)
    return chain


def view_base(gm: fx.GraphModule, node: object) -> object:
    """The value whose memory ``node`` may be (the last of :func:`view_chain`)."""
    return view_chain(gm, node)[-1]


_SEVERAL = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes", "hsplit", "vsplit",
            "dsplit", torch.split, torch.split_with_sizes, torch.tensor_split, torch.hsplit,
            torch.vsplit, torch.dsplit, torch.chunk, torch.unbind, torch.atleast_1d,
            torch.atleast_2d, torch.atleast_3d}
"""View ops of :data:`_VIEW_FUNCTIONS` and :data:`_VIEW_METHODS` that return a tuple of tensors
(``atleast_*d`` where given several)."""
_ATLEAST = (torch.atleast_1d, torch.atleast_2d, torch.atleast_3d)
_INDICES_POSITION = {F.max_pool1d: 6, F.max_pool2d: 6, F.max_pool3d: 6, F.adaptive_max_pool2d: 2}
"""Pooling functions that return a tuple with ``return_indices`` (this positional argument)."""
_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul}
"""Fresh functions that compute numbers too (shape arithmetic)."""


def _marked(node: object) -> bool:
    return isinstance(node, fx.Node) and node.meta.get("tensor", False)


def tensor_result(node: fx.Node, module: Callable[[str], Any],
                  is_tensor: Callable[[object], bool] = _marked) -> bool:
    """Whether ``node``'s value is certainly a tensor, from its op and what ``is_tensor`` says of
    its arguments (earlier nodes; by default their ``meta["tensor"]``, which the tracer sets
    with this; ``module(path)`` is the submodule a ``call_module`` calls): a
    fresh op (:func:`fresh`'s tables) or a view of a tensor; an item of a tuple a tensor op
    split off; a binary operator with a tensor operand. ``False`` where unsure (an op outside
    the tables, a method of a value not known to be a tensor). The tracer answers the model's
    ``isinstance(y, torch.Tensor)`` with it, where fx's proxy answered no."""
    source = alias_source(node)
    of_tensor = source is not None and is_tensor(source)
    if node.op == "call_module":
        m = module(str(node.target))
        if getattr(m, "return_indices", False):  # (a max pooling's tuple)
            return False
        return isinstance(m, _FRESH_MODULES) or of_tensor and isinstance(m, _ALIASING_MODULES)
    if node.op == "call_function":
        position = _INDICES_POSITION.get(node.target)
        if position is not None and (node.kwargs.get("return_indices") or len(
                node.args) > position and node.args[position]):
            return False
        if node.target is operator.getitem:  # an item of a tensor, or of a tensor op's tuple
            return of_tensor or isinstance(source, fx.Node) and source.op != "call_module" and (
                source.target in _SEVERAL and is_tensor(alias_source(source))
                and isinstance(node.args[1], int))  # (a slice of the tuple is a tuple)
        if node.target is torch.where and len(node.args) + len(node.kwargs) < 3:
            return False  # (torch.where(cond): a tuple of indices)
        if node.target in _OPERATORS:
            return any(isinstance(a, fx.Node) and is_tensor(a) for a in node.args[:2])
        return node.target in _FRESH_FUNCTIONS or (
            of_tensor and node.target in _VIEW_FUNCTIONS and node.target not in _SEVERAL)
    if node.op == "call_method":
        if node.target == "type" and len(node.args) + len(node.kwargs) < 2:
            return False  # (x.type(): the type's name)
        return of_tensor and node.target not in _SEVERAL and (
            node.target in _FRESH_METHODS or node.target in _VIEW_METHODS
            or node.target in _SELF_METHODS)
    return False


def shared_input(node: fx.Node, result: Any, values: Mapping[fx.Node, Any]) -> list[str]:
    """The names of the arguments of ``node`` whose values share memory with ``result`` (a
    tensor, or tensors in tuples, lists and dicts), from the values a shape propagation holds
    (``values``: real, meta or fake tensors; a view shares its base's storage in each).
    :mod:`fusion_compiler.shapes` records one as ``meta["shares"]`` (none: ``None``); where
    several share (``torch.broadcast_tensors(a, b)``: one item of the tuple views each), it
    records nothing and the tables answer."""
    made = {_storage(t) for t in _tensors(result)} - {None}
    return [source.name for source in node.all_input_nodes
            if made & {_storage(t) for t in _tensors(values.get(source))}]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: sparse, nested)
        return None


def written_attribute(gm: fx.GraphModule, node: fx.Node) -> tuple[str, Any] | None:
    """The parameter or buffer whose memory the in-place ``node`` writes (its first argument,
    or what that argument is a view of): its path in ``gm`` and value; ``None`` for another
    value."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    base = view_base(gm, node.args[0])
    if not isinstance(base, fx.Node) or base.op != "get_attr":
        return None
    return str(base.target), operator.attrgetter(base.target)(gm)


def written_attributes(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters and buffers ``gm`` writes in place (through views too)."""
    found = [written_attribute(gm, n) for n in gm.graph.nodes if writes_in_place(n)]
    return [value for _, value in filter(None, found)]
