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
made again, and the new one refuses the hook (:mod:`.hooks`). So does a plain attribute a traced
graph holds as a constant (``self.temperature``, a batch norm's ``eps``) set to another value, a
field of a config object set in place, a class attribute ``forward`` reads, or a module-level
name its code may read (a global setting, a helper function;
:func:`fusion_compiler.code_reads.globals_read`); how values are kept and compared is
:mod:`.snapshots`'. What tracing must leave as it was is :mod:`.module_writes`'.
"""

from __future__ import annotations

import logging
import operator
import types
import weakref
from itertools import repeat
from typing import Any, Sequence

import torch
import torch.fx as fx

from ..ir.aliasing import written_attributes
from ..ir.errors import FusionError, condense
from .hooks import hook_tables, instance_forward
from .snapshots import (MISSING, MODULE_INTERNALS, changed_in_place, kept, order, plain, same,
                        short, small)

__all__ = ["StateGuard", "plain", "note_reads", "first_time"]

log = logging.getLogger("fusion_compiler")

_data_ptr = torch.Tensor.data_ptr
_TRAINING = operator.attrgetter("training")


_UNREAD = frozenset({"training", "in_channels", "out_channels", "kernel_size", "transposed",
                     "in_features", "out_features", "num_features"})
"""Attributes of ``torch.nn``'s own modules that their ``forward`` does not read (the sizes follow
from the weights' shapes; ``training`` is in the specialization key)."""


_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> names a trace read


_GLOBALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> globals read
_VALUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> tensors read as values
_TOLD: weakref.WeakSet = weakref.WeakSet()  # models told what the guard does not compare


def _data(value: Any) -> bool:
    """A data value of a class (a number, a list, a config object): no method, property or
    other descriptor, nothing callable."""
    return not (callable(value) or hasattr(value, "__get__"))


def note_reads(reads: dict[torch.nn.Module, set[str]], model: torch.nn.Module,
               global_names: Sequence[tuple[Any, str]],
               values: Sequence[tuple[dict, str]] = ()) -> None:
    """Add the attribute names a trace saw each module's code read, the module-level names
    the code of ``model``'s trace may read (``(globals dict, name)``, or ``(class, name)`` for
    ``Defaults.SCALE``), and the plain tensor attributes it read as Python values (``(module's
    __dict__, name)``: :func:`~fusion_compiler.tensor_reads.values_read`); they accumulate over
    the traces of a model (each specialization is traced again)."""
    for module, names in reads.items():
        _READS.setdefault(module, set()).update(names)
    _GLOBALS.setdefault(model, {}).update({(id(g), n): (g, n) for g, n in global_names})
    _VALUES.setdefault(model, {}).update({(id(d), n): (d, n) for d, n in values})


def _class_attributes(module: torch.nn.Module) -> list[tuple[type, str, Any]]:
    """``(class, name, value)`` of the values ``module``'s code may read from its class: the
    ones a trace saw it read through ``self`` (``self.SCALE`` of a class-level ``SCALE = 2.0``)
    and their methods (one replaced on the class is another function object), and, where a trace
    ran the module's code, every other data value of its classes that is
    :func:`~.snapshots.small` (``type(self).SCALE`` and ``self.__class__.SCALE`` are not reads
    through ``self``; a class-level table of thousands of entries read that way is not compared,
    to keep each call's check short), base classes' own values too (``type(self).__mro__[1]``):
    the class is ``module``'s own, where a subclass may set it later. Not properties, classes or
    other callables, not Python's own names (``__module__``) nor those of torch's classes
    (``nn.Module``'s ``_compiled_call_impl``, which ``__call__`` reads). Lists, dicts and
    objects' fields are copies (they may change in place)."""
    tables = (vars(module), module._parameters, module._buffers, module._modules)
    read = _READS.get(module)
    names = set(read or ())
    if read is not None:  # the classes' data values: no method, no descriptor, none large
        names.update(n for k in type(module).__mro__ if not k.__module__.startswith("torch.")
                     and k is not object for n, v in vars(k).items()
                     if _data(v) and small(v))
    found = []
    for name in sorted(names):
        if any(name in t for t in tables) or name.startswith("__"):
            continue
        owner = next((k for k in type(module).__mro__ if name in vars(k)), None)
        if owner is None or owner.__module__.startswith("torch."):
            continue
        value = vars(owner)[name]
        if isinstance(value, types.FunctionType) or _data(value):
            found.append((type(module), name, kept(value)))  # a method: by identity
            # a base class's own value (``type(self).__mro__[1].K``, ``Base.K`` in a method)
            found += [(k, name, kept(vars(k)[name])) for k in type(module).__mro__[1:]
                      if name in vars(k) and k is not owner
                      and not k.__module__.startswith("torch.")]
    return found


def _globals_guarded(model: torch.nn.Module) -> list[tuple[dict, str, Any]]:
    """``(globals dict, name, value)`` of the module-level names ``model``'s traced code may
    read (:func:`note_reads`), modules (``torch``, ``F``) left out; functions are compared by
    identity (one replaced is a new object)."""
    return [(g, n, g[n]) for g, n in _GLOBALS.get(model, {}).values()
            if isinstance(g, dict) and n in g and not isinstance(g[n], types.ModuleType)]


def _global_classes(model: torch.nn.Module) -> list[tuple[type, str, Any]]:
    """``(class, name, value)`` of the data values the traced code may read from a class of the
    user's by its global name (``Defaults.SCALE``; :func:`note_reads`), and ``(cell,
    "cell_contents", value)`` of those a closure of its code holds."""
    found = []
    for cls, n in _GLOBALS.get(model, {}).values():
        value = (getattr(cls, n, MISSING) if isinstance(cls, (type, types.CellType))
                 else MISSING)
        if value is not MISSING and _data(value):
            found.append((cls, n, value))
    return found


def _torch_nn(module: torch.nn.Module) -> bool:
    """One of ``torch.nn``'s own modules (its ``forward`` reads its attributes when it runs)."""
    return type(module).__module__.startswith("torch.nn.")


def _guarded(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """The attributes of ``module`` the guard compares: tensors that are neither parameters nor
    buffers; for ``torch.nn``'s own modules their public values less :data:`_UNREAD` (plain ones,
    and an object the user's code set on one: ``self.conv.extra.scale``); for
    others every value (not nn.Module's own) that a trace saw its code read
    (:func:`note_reads`), or all of them where no trace ran its code; compared as
    :mod:`.snapshots` says (plain values, lists and dicts by value; a config object's fields and
    a NumPy array's contents copied; other objects by identity)."""
    if _torch_nn(module):
        return [(n, v) for n, v in vars(module).items() if n not in _UNREAD and (
            isinstance(v, torch.Tensor) or not n.startswith("_"))]
    read = _READS.get(module)
    return [(n, v) for n, v in vars(module).items() if n not in MODULE_INTERNALS and (
        isinstance(v, torch.Tensor) or read is None or n in read)]


class StateGuard:
    """Holds what ``module``'s tree, parameters and buffers were when last :meth:`taken`.

    :meth:`changed` costs one dictionary lookup, one identity test and one address read per
    tensor, one lookup per submodule and one lookup and comparison per plain attribute
    (measured: docs/options.md, "The cost of current state").
    """

    def __init__(self, module: torch.nn.Module, graph: fx.GraphModule | None = None):
        self.module = module
        written = {id(t) for t in written_attributes(graph)} if graph is not None else set()
        self._watched = [(d, n) for m in module.modules() for d in (m._parameters, m._buffers)
                         for n, t in d.items() if id(t) in written]
        self.take()

    def take(self) -> None:
        """Remember the module as it is now."""
        modules = list(self.module.modules())
        holders = [(d, n) for m in modules for d in (m._parameters, m._buffers)
                   for n, t in d.items() if t is not None]
        # a slot registered as None (a conv's bias=False, register_buffer("mask", None)) that
        # gets a tensor changes what forward computes (the graph has no node for it)
        self._empty = [(d, n) for m in modules for d in (m._parameters, m._buffers)
                       for n, t in d.items() if t is None]
        self._dicts = [d for d, _ in holders]
        self._names = [n for _, n in holders]
        self.tensors: tuple[torch.Tensor, ...] = tuple(map(dict.get, self._dicts, self._names))
        try:
            self._ptrs = list(map(_data_ptr, self.tensors))
        except RuntimeError as exc:  # functorch's wrapped tensors, fake tensors: no storage
            raise FusionError(
                f"a compiled module was called with parameters or buffers that have no storage "
                f"({condense(str(exc), limit=80)}): inside torch.func transforms "
                "(grad, vmap over functional_call) call the model uncompiled") from exc
        # the storages of the state the graph writes in place (an input sharing one reads the
        # value before the write, where eager reads the one after: such a call runs eagerly)
        self.storages = frozenset(d[n].untyped_storage().data_ptr() for d, n in self._watched
                                  if d.get(n) is not None)
        children = [(m._modules, n) for m in modules for n in m._modules]
        self._module_dicts = [d for d, _ in children]
        self._module_names = [n for _, n in children]
        self._children = tuple(map(dict.get, self._module_dicts, self._module_names))
        self._child_tables = [m._modules for m in modules]  # a submodule added: forward may
        self._child_counts = list(map(len, self._child_tables))  # iterate them, or test "in"
        # a ModuleDict's order (forward iterates it; the same modules re-inserted reorder it)
        self._orders = [(m._modules, tuple(m._modules)) for m in modules
                        if isinstance(m, torch.nn.ModuleDict)]
        # a forward replaced on an instance (``m.forward = ...``) is what nn.Module.__call__ runs
        self._modules = modules
        self._vars = [vars(m) for m in modules]
        self._forwards = list(map(instance_forward, modules))
        self._hook_tables = hook_tables(self.module)
        self._hooks = sum(map(len, self._hook_tables))
        attributes = [(vars(m), n, v) for m in modules for n, v in _guarded(m)]
        attributes += _globals_guarded(self.module)  # compared as attributes are (dicts too)
        self._class_values = [a for m in modules for a in _class_attributes(m)]
        self._class_values += [(k, n, kept(v)) for k, n, v in _global_classes(self.module)]
        self._class_types = [k for k, _, _ in self._class_values]
        self._class_names = [n for _, n, _ in self._class_values]
        self._class_kept = tuple(v for _, _, v in self._class_values)
        attributes.sort(key=lambda a: order(a[2]))  # by ==, then by identity, then item by item
        self._attr_dicts = [d for d, _, _ in attributes]
        self._attr_names = [n for _, n, _ in attributes]
        unseen: list[str] = []
        self._attr_values = tuple(kept(v, unseen) for _, _, v in attributes)
        if unseen:
            _tell_unseen(self.module, unseen)
        orders = [order(v) for v in self._attr_values]
        self._plain, self._objects = orders.count(0), orders.count(0) + orders.count(1)
        # the training flags of every module: ``if self.training:`` in code a trace runs is
        # traced as a constant, and that code may read a torch.nn submodule's flag too
        # (``self.bn.training``), which that module alone may change (``model.bn.eval()``)
        self._traced = list(modules)
        # names a trace saw forward read that the module did not have (``hasattr(self, "x")``,
        # a class-level default): one set on the module later changes what forward computes
        tables = [((vars(m), m._parameters, m._buffers, m._modules), type(m), _READS.get(m, ()))
                  for m in modules]
        self._absent = [(t, n) for t, cls, names in tables for n in sorted(names)
                        if not any(n in d for d in t) and _settable(cls, n)]
        # plain tensor attributes the trace read as Python values (self.k.item()): constants
        # of the graph, compared by contents (a sync for a GPU tensor, as eager's read is)
        read = _VALUES.get(self.module, {}).values()
        self._values = [(d, n, d[n], d[n].clone()) for d, n in read
                        if isinstance(d.get(n), torch.Tensor)]

    def training_flags(self) -> tuple[bool, ...]:
        """The ``training`` flags of the model's modules: part of a specialization's key, since
        ``if self.training:`` (or ``if self.bn.training:``) in code a trace runs is traced as a
        constant (a backbone put in eval mode under a training root; a batch norm frozen by
        ``model.bn.eval()`` whose flag the parent's code reads). ``torch.nn``'s own modules read
        theirs when they run; theirs are in the key for the code of others that reads them."""
        return tuple(map(_TRAINING, self._traced))

    def _forward_changed(self) -> bool:
        # the instance dictionaries first (in C); a difference may be the hook swap of one call
        return (list(map(dict.get, self._vars, repeat("forward"))) != self._forwards
                and list(map(instance_forward, self._modules)) != self._forwards)

    def _attributes_changed(self) -> bool:
        now = tuple(map(dict.get, self._attr_dicts, self._attr_names))
        k, j = self._plain, self._objects  # ==, identity first (in C); identity; item by item
        if (now[:k] == self._attr_values[:k]
                and all(map(operator.is_, now[k:j], self._attr_values[k:j]))
                and all(map(same, self._attr_values[j:], now[j:]))):
            return False
        if not all(map(same, self._attr_values, now)):
            return True
        # equal values set again: nothing to compile
        self._attr_values = tuple(map(kept, now))
        return False

    def changed(self) -> bool:
        """Whether a parameter, buffer or submodule was replaced or removed since :meth:`take`
        (a tensor's memory replaced too; one registered as ``None`` set; a ``ModuleDict``
        reordered), a hook added or removed below the root, a module's
        ``forward`` replaced (or put back) on the instance, a plain
        attribute (a number, a tensor that is no parameter or buffer) set to another value, or
        an attribute, parameter, buffer or submodule added under a name a trace saw ``forward``
        read and not find (``hasattr(self, "shift")``), a submodule added anywhere, a class
        attribute a trace saw ``forward`` read set on the class, or a module-level name the
        traced code may read set to another value. Tensors added under other names are not
        looked for: the traced graph does not read them."""
        now = tuple(map(dict.get, self._dicts, self._names))
        if not all(map(operator.is_, now, self.tensors)):
            return True
        if not all(map(operator.is_, map(dict.get, self._module_dicts, self._module_names),
                       self._children)) or list(map(len, self._child_tables)) != self._child_counts:
            return True
        return (list(map(_data_ptr, now)) != self._ptrs
                or any(d.get(n) is not None for d, n in self._empty)
                or any(tuple(d) != keys for d, keys in self._orders)
                or sum(map(len, self._hook_tables)) != self._hooks
                or self._forward_changed() or self._attributes_changed()
                or any(n in t for tables, n in self._absent for t in tables)
                or self._class_changed() or self._changed_value() is not None)

    def _changed_value(self) -> str | None:
        """The name of a tensor attribute read as a value whose contents changed (or that was
        replaced), else ``None``."""
        return next((n for d, n, t, old in self._values
                     if d.get(n) is not t or not torch.equal(t, old)), None)

    def _class_changed(self) -> bool:
        try:  # the same objects (methods, numbers) in C; copies of lists item by item
            now = tuple(map(getattr, self._class_types, self._class_names))
        except AttributeError:  # deleted from the class
            return True
        return not all(map(operator.is_, now, self._class_kept)) and not all(
            map(same, self._class_kept, now))

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
        if list(map(len, self._child_tables)) != self._child_counts:
            return "a submodule was added"
        for d, n in self._empty:
            if d.get(n) is not None:
                return f"'{n}' was set (it was None)"
        if any(tuple(d) != keys for d, keys in self._orders):
            return "a ModuleDict's order changed"
        if sum(map(len, self._hook_tables)) != self._hooks:
            return "a hook was added or removed on a submodule (or a global one)"
        if self._forward_changed():
            return "a module's forward was replaced on the instance"
        for d, n, old in zip(self._attr_dicts, self._attr_names, self._attr_values):
            new = d.get(n, MISSING)
            if not same(old, new):
                what = "global" if "__builtins__" in d else "attribute"  # a module's globals
                return f"{what} '{n}' was {_change(old, new)}"
        for tables, n in self._absent:
            if any(n in t for t in tables):
                return f"attribute '{n}' was added (forward looked for it)"
        for k, n, v in self._class_values:
            now = getattr(k, n, MISSING)
            if not same(v, now):
                what = (f"class attribute {k.__name__}.{n}" if isinstance(k, type)
                        else "closure value of forward's code")
                return f"{what} was {_change(v, now)}"
        name = self._changed_value()
        if name is not None:  # (as an attribute: RECOMPILE_LIMIT applies)
            return f"attribute '{name}' (a tensor forward reads as a number) was changed"
        return "nothing"


def first_time(told: weakref.WeakSet, model: torch.nn.Module) -> bool:
    """Whether ``model`` is not in ``told`` yet (it is added): for a WARNING once per model. A
    model that cannot be hashed (a class with ``__eq__`` and no ``__hash__``) is told each
    time."""
    try:
        if model in told:
            return False
        told.add(model)
    except TypeError:
        pass
    return True


def _tell_unseen(model: torch.nn.Module, unseen: list[str]) -> None:
    """One WARNING per model: values ``forward`` reads whose contents the guard does not compare
    (too large to compare at every call; a change in place will not be seen)."""
    if not first_time(_TOLD, model):
        return
    log.warning("%s: forward reads %s; the compiled model compares %s by identity only, so a "
                "change of %s contents in place is not seen: keep such data in a buffer, or "
                "pass it as an argument", type(model).__name__, ", ".join(sorted(set(unseen))),
                "it" if len(set(unseen)) == 1 else "them", "its" if len(set(unseen)) == 1
                else "their")


def _change(old: Any, new: Any) -> str:
    """How a guarded value changed, for a log line."""
    if changed_in_place(old, new):  # an object's fields or an array's contents
        return "changed in place"
    return f"set to {short(new)} (was {short(old)})"


def _settable(cls: type, name: str) -> bool:
    """Whether an instance of ``cls`` would hold ``name`` in its own tables if set, and be read
    from there: not a property (or another data descriptor) or Python's own (``__dict__``) of
    the class; a class-level default value or a method is (an instance may shadow it:
    ``model.post = lambda y: y * 3``)."""
    if name.startswith("__") and name.endswith("__"):
        return False
    found = getattr(cls, name, MISSING)
    kind = type(found)
    return found is MISSING or not (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))
