"""The module's state as the compiled specializations use it: which tensor objects, at which
addresses, in which submodules, with which hooks.

A specialization reads the module's parameters and buffers in place: its CUDA graphs captured
their addresses, its compiled glue holds the tensor objects, its derivation program fingerprints
their memory. So a parameter or buffer that is *replaced* (``load_state_dict(assign=True)``, an
attribute set to a new tensor, ``module.half()`` and ``.to()`` (new buffers; parameters get new
memory through ``p.data = ...``), a submodule swapped) makes every specialization stale, however
its contents compare. :class:`StateGuard` finds that before each call, by identity and address;
what is changed *in place* is the derivation program's to find (:mod:`.derive`). A hook added
to a submodule (or a global one) changes what the model computes too: the specializations are
made again, and the new one refuses the hook (:mod:`.hooks`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .hooks import hook_tables

__all__ = ["StateGuard"]

_data_ptr = torch.Tensor.data_ptr


class StateGuard:
    """Holds what ``module``'s tree, parameters and buffers were when last :meth:`taken`.

    :meth:`changed` costs one dictionary lookup, one identity test and one address read per
    tensor and one lookup per submodule (measured: docs/options.md, "The cost of current state").
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.take()

    def take(self) -> None:
        """Remember the module as it is now."""
        modules = list(self.module.modules())
        holders = [(d, n) for m in modules for d in (m._parameters, m._buffers)
                   for n, t in d.items() if t is not None]
        self._dicts = [d for d, _ in holders]
        self._names = [n for _, n in holders]
        self.tensors: tuple[torch.Tensor, ...] = tuple(map(dict.get, self._dicts, self._names))
        self._ptrs = list(map(_data_ptr, self.tensors))
        children = [(m._modules, n) for m in modules for n in m._modules]
        self._module_dicts = [d for d, _ in children]
        self._module_names = [n for _, n in children]
        self._children = tuple(map(dict.get, self._module_dicts, self._module_names))
        self._hook_tables = hook_tables(self.module)
        self._hooks = sum(map(len, self._hook_tables))

    def changed(self) -> bool:
        """Whether a parameter, buffer or submodule was replaced or removed since :meth:`take`
        (a tensor's memory replaced too), or a hook added or removed below the root. Tensors and
        submodules added since are not looked for: the traced graph does not read them."""
        now = tuple(map(dict.get, self._dicts, self._names))
        if not all(map(operator.is_, now, self.tensors)):
            return True
        if not all(map(operator.is_, map(dict.get, self._module_dicts, self._module_names),
                       self._children)):
            return True
        return (list(map(_data_ptr, now)) != self._ptrs
                or sum(map(len, self._hook_tables)) != self._hooks)

    def describe(self) -> str:
        """Which tensor or submodule changed, for a log line."""
        for d, n, t, ptr in zip(self._dicts, self._names, self.tensors, self._ptrs):
            now: Any = d.get(n)
            if now is not t:
                return f"'{n}' was replaced"
            if now.data_ptr() != ptr:
                return f"'{n}' was given new memory"
        for d, n, child in zip(self._module_dicts, self._module_names, self._children):
            if d.get(n) is not child:
                return f"submodule '{n}' was replaced"
        if sum(map(len, self._hook_tables)) != self._hooks:
            return "a hook was added or removed on a submodule (or a global one)"
        return "nothing"
