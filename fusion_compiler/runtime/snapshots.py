"""What :class:`~fusion_compiler.runtime.state.StateGuard` keeps of a Python value a traced
``forward`` read, and how it tells whether the value is still the same.

A traced graph holds what ``forward`` read from Python as constants: ``self.scale`` (a number),
``self.cfg.act == "gelu"`` (a branch taken), ``float(self.table[3])``. The guard keeps each such
value as it was and compares it before every call:

- plain values (numbers, strings, ``None``, dtypes; tuples of them) and lists and dicts of them by
  value (lists and dicts copied: they may change in place);
- lists, tuples and dicts holding other objects item by item;
- objects that hold data in fields (a dataclass, ``types.SimpleNamespace``, ``argparse.Namespace``,
  a ``functools.partial``'s function and bound arguments, any instance with a ``__dict__`` or
  ``__slots__`` that is not a module, tensor, function, class or an object of Python's own
  library such as a logger): the same object, its fields copied and
  compared in turn (``cfg.scale = 2.0`` changes what ``forward`` computes; which fields the code
  reads is not known for sure, through methods, ``vars()`` or names built at run time, so all
  are compared: a field the code never reads that changes, a step counter, compiles again),
  nested objects up to :data:`DEPTH` levels, and at most :data:`BUDGET` fields and container
  items in all (past that, by identity: :func:`kept` says so);
- NumPy arrays of numbers, up to :data:`ARRAY_LIMIT` elements: the same array with the same
  contents (a copy kept; NaN equal to NaN); larger ones and arrays of objects by identity;
- anything else (a tensor, an enum member, a function, a weak proxy, a ``threading.local``) by
  identity.
"""

from __future__ import annotations

import argparse
import enum
import functools
import sys
import threading
import types
import weakref
from typing import Any

import torch

__all__ = ["plain", "kept", "same", "order", "short", "small", "changed_in_place", "fields_of",
           "MISSING", "MODULE_INTERNALS", "DEPTH", "BUDGET", "ARRAY_LIMIT", "SMALL"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.memory_format, torch.layout)
MISSING = object()
"""Stands for a value that is not there (an attribute deleted)."""
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
"""The names of ``nn.Module``'s own bookkeeping in a module's ``__dict__`` (its tables of
parameters, buffers and submodules, its hook dictionaries, ``training``)."""
DEPTH = 8
"""Levels of objects within objects whose fields :func:`kept` keeps."""
BUDGET = 4096
"""Fields and container items :func:`kept` keeps for one value, in all."""
ARRAY_LIMIT = 1 << 16
"""Elements of a NumPy array up to which :func:`kept` keeps a copy (comparing 65536 float32
values costs about 10 µs a call)."""
_OPAQUE = (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, enum.Enum,
           threading.local, *weakref.ProxyTypes, weakref.ref)


def plain(value: Any) -> bool:
    """Whether ``value`` is an immutable Python value (a number, string, ``None``, dtype, device,
    or a tuple of them): what a traced graph holds as a constant when ``forward`` reads it."""
    if isinstance(value, tuple):
        return all(map(plain, value))
    return isinstance(value, _PLAIN)


def _container(value: Any) -> bool:
    """A list or dict of plain values (compared by value: it may change in place)."""
    if isinstance(value, dict):
        return all(map(plain, value)) and all(map(plain, value.values()))
    return isinstance(value, list) and all(map(plain, value))


def _array(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # no array exists where NumPy is not imported
    return numpy is not None and isinstance(value, numpy.ndarray)


def _fields(value: Any) -> dict[str, Any] | None:
    """The fields of an object that holds data (its ``__dict__`` and its ``__slots__``, read
    past any ``__getattr__``; a ``functools.partial``'s function and bound arguments, which may
    hold a config object); ``None`` for other objects."""
    if isinstance(value, functools.partial):
        return {"func": value.func, "args": value.args, "keywords": value.keywords}
    if (isinstance(value, _OPAQUE) or plain(value) or _array(value)
            or isinstance(value, (list, tuple, dict, set, frozenset)) or _library_object(value)):
        return None
    try:
        found = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 (no __dict__, or an object that refuses to say)
        found = None
    names = [n for k in type(value).__mro__ for n in _slots(k) if n != "__dict__"]
    if not names:  # the common case: the instance dictionary itself, read, not copied
        return found if isinstance(found, dict) else None
    fields = dict(found) if isinstance(found, dict) else {}
    for n in names:
        try:
            fields[n] = object.__getattribute__(value, n)
        except Exception:  # noqa: BLE001 (a slot not set)
            fields[n] = MISSING
    return fields


def fields_of(value: Any) -> dict[str, Any] | None:
    """A copy of the fields of ``value`` where it is an object that holds data in fields (see the
    module docstring; its ``__dict__`` and ``__slots__``), else ``None``."""
    fields = _fields(value)
    return None if fields is None else dict(fields)


_CONTAINERS = (types.SimpleNamespace, argparse.Namespace)
"""The standard library's objects that hold a program's settings in fields; its other objects
(loggers, locks, executors, files) are compared by identity."""


def _library_object(value: Any) -> bool:
    """An object of a class of Python's standard library other than :data:`_CONTAINERS`."""
    module = type(value).__module__.split(".")[0]
    return module in sys.stdlib_module_names and not isinstance(value, _CONTAINERS)


def _slots(cls: type) -> tuple[str, ...]:
    names = vars(cls).get("__slots__", ())
    return (names,) if isinstance(names, str) else tuple(n for n in names if n != "__weakref__")


class _Fields:
    """An object, its class and a copy of its fields (nested objects' too, to a depth)."""

    __slots__ = ("obj", "cls", "fields")

    def __init__(self, obj: Any, fields: dict[str, Any]):
        self.obj, self.cls, self.fields = obj, type(obj), fields


class _Array:
    """A NumPy array and a copy of its contents."""

    __slots__ = ("obj", "copy")

    def __init__(self, obj: Any):
        self.obj, self.copy = obj, obj.copy()


def _copied(value: Any) -> bool:
    """A NumPy array :func:`kept` copies: numbers, at most :data:`ARRAY_LIMIT` elements."""
    return value.dtype.kind in "biufc" and value.size <= ARRAY_LIMIT


SMALL = 64
"""Items of a list, tuple or dict, and elements of a NumPy array, up to which :func:`small` says
a value is small."""


def small(value: Any) -> bool:
    """Whether comparing ``value`` at every call is cheap: a plain value, an object with fields
    (bounded by :data:`BUDGET`), a container or NumPy array of at most :data:`SMALL` items."""
    if isinstance(value, (list, tuple, dict)):
        return len(value) <= SMALL
    if _array(value):
        return value.size <= SMALL
    return True


def kept(value: Any, unseen: list[str] | None = None) -> Any:
    """What the guard keeps of ``value``: copies of lists and dicts (nested ones too: they may
    change in place), of an object's fields and of a NumPy array's contents; the value itself
    otherwise. Objects within objects are followed
    :data:`DEPTH` levels deep, and at most :data:`BUDGET` fields and items in all; what is kept
    as itself past those bounds, or as a large array, is described in ``unseen`` (a change of
    its contents will not be seen)."""
    return _kept(value, DEPTH, [BUDGET], [] if unseen is None else unseen, set())


def _kept(value: Any, depth: int, budget: list[int], unseen: list[str], open_: set[int]) -> Any:
    if isinstance(value, (list, dict)) or (isinstance(value, tuple) and not plain(value)):
        if len(value) > budget[0]:
            unseen.append(f"a {type(value).__name__} of {len(value)} items")
            return value
        budget[0] -= len(value)
        if id(value) in open_:  # a container that holds itself
            return value
        open_.add(id(value))
        try:
            if isinstance(value, list):
                return [_kept(v, depth, budget, unseen, open_) for v in value]
            if isinstance(value, dict):
                return {k: _kept(v, depth, budget, unseen, open_) for k, v in value.items()}
            items = [_kept(v, depth, budget, unseen, open_) for v in value]
        finally:
            open_.discard(id(value))
        if type(value) is tuple:  # holding objects: their items kept
            return tuple(items)
        make = getattr(type(value), "_make", None)  # a named tuple keeps its class
        return make(items) if make is not None else value
    if _array(value):
        if _copied(value):
            return _Array(value)
        unseen.append(f"a NumPy array of {value.size} {value.dtype} elements")
        return value
    fields = _fields(value)
    if fields is None:
        return value
    if depth == 0:
        unseen.append(f"a {type(value).__name__} nested more than {DEPTH} levels deep")
        return value
    if len(fields) > budget[0]:
        unseen.append(f"a {type(value).__name__} of {len(fields)} fields")
        return value
    budget[0] -= len(fields)
    return _Fields(value, {k: _kept(v, depth - 1, budget, unseen, open_)
                           for k, v in fields.items()})


def same(old: Any, new: Any) -> bool:
    """Whether ``new`` is what ``old`` (kept by :func:`kept`) was: plain values and lists or
    dicts of them by value; lists, tuples and dicts holding other objects item by item; an object
    with fields the same object with the same fields; a NumPy array the same array with the same
    contents; any other object by identity."""
    if old is new:
        return True
    if isinstance(old, _Fields):  # the same object, of the same class (``obj.__class__ = B``)
        fields = _fields(new) if new is old.obj and type(new) is old.cls else None
        return fields is not None and fields.keys() == old.fields.keys() and all(
            same(v, fields[k]) for k, v in old.fields.items())
    if isinstance(old, _Array):
        return new is old.obj and _equal_arrays(new, old.copy)
    if type(old) is type(new) and type(old) in (list, dict):
        try:  # plain items in C; items kept as copies of objects compare unequal
            if old == new:
                return True
        except Exception:  # noqa: BLE001 (an item that does not compare: a tensor, an array)
            pass
    if (plain(old) or _container(old)) and type(old) is type(new):
        return old == new
    if isinstance(old, (list, tuple)) and type(old) is type(new) and len(old) == len(new):
        return all(map(same, old, new))
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        return all(same(v, new[k]) for k, v in old.items())
    return False


def _equal_arrays(a: Any, b: Any) -> bool:
    """NumPy arrays of numbers of one shape and dtype with equal elements, NaN equal to NaN (a
    table holding one would otherwise differ from its copy at every call)."""
    numpy = sys.modules["numpy"]  # an array exists: NumPy is imported
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def changed_in_place(old: Any, new: Any) -> bool:
    """Whether ``new`` is the object ``old`` (kept by :func:`kept`) was kept of: an object's
    fields or an array's contents changed, not the object."""
    return isinstance(old, (_Fields, _Array)) and new is old.obj


def order(value: Any) -> int:
    """Where a value goes in the guard's comparison: 0 by ``==`` (plain values, lists and dicts
    of them), 1 by identity (tensors, other objects), 2 by :func:`same` (containers of objects,
    objects with fields, arrays)."""
    if plain(value) or _container(value):
        return 0
    if isinstance(value, (list, tuple, dict, _Fields, _Array)) or _array(value):
        return 2
    return 2 if _fields(value) is not None else 1


def short(value: Any) -> str:
    """``value`` in a few words, for a log line."""
    if value is MISSING:
        return "nothing (deleted)"
    if isinstance(value, (_Fields, _Array)):
        return f"a {type(value.obj).__name__} holding other values"
    if isinstance(value, torch.Tensor) or _array(value) or _fields(value) is not None:
        return f"a {type(value).__name__}"
    return repr(value)[:40]
