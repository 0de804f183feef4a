"""identities: ops that return their input unchanged in the graph being compiled, removed.

A network written for training keeps layers that do nothing in inference: dropout in eval mode
(``nn.Dropout``, ``Dropout1d``/``2d``/``3d``, ``AlphaDropout``, ``FeatureAlphaDropout`` and their
functions with ``training=False``) and torchvision's stochastic depth
(``torchvision.ops.stochastic_depth`` with ``training=False`` or ``p == 0``, what its
``StochasticDepth`` module calls: EfficientNet, ConvNeXt). Each returns its input tensor itself
(the same object, no copy), so reading the input instead is exact: the same values, the same
memory. Left in the graph they are ops the fuse pass cannot take, and the residual add after
EfficientNet's stochastic depth stayed out of the projection convolution's region.

A module's mode is read when the graph is compiled; the compiled model keeps one specialization
per mode of its modules (``CompiledModule``'s key holds every module's ``training`` flag), and a
function's ``training`` argument is a constant of the captured graph. Train-mode dropout, which
draws random numbers, is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ...ir.aliasing import is_torchvision_stochastic_depth

__all__ = ["drop_identities"]

_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True,
                      F.alpha_dropout: False, F.feature_alpha_dropout: False}
"""Dropout functions, each with the default of its ``training`` argument."""


def drop_identities(gm: fx.GraphModule) -> list[str]:
    """Remove, in place, each node of ``gm`` that returns its input itself (see the module doc):
    its readers read its input. Any shape and dtype; a node whose ``training`` argument is not a
    constant ``False`` (a graph input, or ``True``) is kept, and so is every node of a graph that
    keeps in-place ops (``gm.meta["fusion_off"]``, run as it is). Returns the names of the nodes
    removed. Raises nothing."""
    if gm.meta.get("fusion_off"):
        return []
    g = gm.graph
    done = []
    for node in list(g.nodes):
        x = _identity_input(gm, node)
        if isinstance(x, fx.Node):
            node.replace_all_uses_with(x)
            g.erase_node(node)
            done.append(node.name)
    if done:
        g.lint()
        gm.recompile()
    return done


def _identity_input(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The input ``node`` returns unchanged, or ``None``."""
    if node.op == "call_module" and len(node.args) == 1 and not node.kwargs:
        mod = gm.get_submodule(node.target)
        if type(mod) in _DROPOUT_MODULES and not mod.training:
            return node.args[0]
        return None
    if node.op != "call_function" or not node.args:
        return None
    if node.target in _DROPOUT_FUNCTIONS:
        training = _argument(node, 2, "training", _DROPOUT_FUNCTIONS[node.target])
        return node.args[0] if training is False else None
    if is_torchvision_stochastic_depth(node.target):
        p, training = _argument(node, 1, "p", None), _argument(node, 3, "training", True)
        return node.args[0] if training is False or p == 0 else None
    return None


def _argument(node: fx.Node, index: int, name: str, default: Any) -> Any:
    """The argument ``name`` of the call ``node`` (position ``index``), or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)
