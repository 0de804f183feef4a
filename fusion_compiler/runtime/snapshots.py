"""What :class:`~fusion_compiler.runtime.state.StateGuard` keeps of a Python value a traced
``forward`` read, and how it tells whether the value is still the same.

A traced graph holds what ``forward`` read from Python as constants: ``self.scale`` (a number),
``self.cfg.act == "gelu"`` (a branch taken), ``float(self.table[3])``. The guard keeps each such
value as it was and compares it before every call:

- plain values (numbers, strings, ``None``, dtypes; tuples of them) and lists and dicts of them by
  value (lists and dicts copied: they may change in place);
- lists, tuples and dicts holding other objects item by item;
- objects that hold data in fields (a dataclass, ``types.SimpleNamespace``, ``argparse.Namespace``,
  any instance with a ``__dict__`` or ``__slots__`` that is not a module, tensor, function or
  class): the same object, and the fields whose names the model's code reads (the guard passes
  them: a static reading of the bytecode, :func:`fusion_compiler.tracing.globals_read`, with the
  names the object's own class's methods and properties read) copied and compared in turn, so
  ``cfg.scale = 2.0`` changes what ``forward`` computes and a ``cfg.step`` that ``forward`` never
  reads does not; nested objects up to :data:`DEPTH` levels, and at most :data:`BUDGET` fields
  and container items in all (past that, by identity: :func:`kept` says so);
- NumPy arrays of numbers, up to :data:`ARRAY_LIMIT` elements: the same array with the same
  contents (a copy kept; NaN equal to NaN); larger ones and arrays of objects by identity;
- anything else (a tensor, a ``functools.partial``, an enum member, a function, a weak proxy, a
  ``threading.local``) by identity.
"""

from __future__ import annotations

import argparse
import dis
import enum
import functools
import sys
import threading
import types
import weakref
from typing import Any, Iterable

import torch

__all__ = ["plain", "kept", "same", "order", "short", "changed_in_place", "fields_of", "MISSING",
           "DEPTH", "BUDGET", "ARRAY_LIMIT"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.memory_format, torch.layout)
MISSING = object()
"""Stands for a value that is not there (an attribute deleted)."""
DEPTH = 8
"""Levels of objects within objects whose fields :func:`kept` keeps."""
BUDGET = 4096
"""Fields and container items :func:`kept` keeps for one value, in all."""
ARRAY_LIMIT = 1 << 16
"""Elements of a NumPy array up to which :func:`kept` keeps a copy (comparing 65536 float32
values costs about 10 µs a call)."""
_OPAQUE = (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, functools.partial, enum.Enum,
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
    past any ``__getattr__``); ``None`` for other objects."""
    if (isinstance(value, _OPAQUE) or plain(value) or _array(value)
            or isinstance(value, (list, tuple, dict, set, frozenset)) or _library_object(value)):
        return None
    try:
        found = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 (no __dict__, or an object that refuses to say)
        found = None
    names = [n for k in type(value).__mro__ for n in _slots(k) if n != "__dict__"]
    if not isinstance(found, dict) and not names:
        return None
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


@functools.lru_cache(maxsize=1024)
def _class_reads(cls: type) -> frozenset[str]:
    """The attribute names the properties of ``cls`` (and of its bases) read: a property
    ``cfg.width`` computed from ``self.base`` (a method a forward calls is not followed)."""
    names: set[str] = set()
    for k in cls.__mro__:
        for value in vars(k).values():
            code = getattr(getattr(value, "fget", None), "__code__", None)
            if isinstance(code, types.CodeType):
                names.update(_code_reads(code))
    return frozenset(names)


_CONTAINERS = (types.SimpleNamespace, argparse.Namespace)
"""The standard library's objects that hold a program's settings in fields; its other objects
(loggers, locks, executors, files) are compared by identity."""


def _library_object(value: Any) -> bool:
    """An object of a class of Python's standard library other than :data:`_CONTAINERS`."""
    module = type(value).__module__.split(".")[0]
    return module in sys.stdlib_module_names and not isinstance(value, _CONTAINERS)


def _code_reads(code: types.CodeType) -> Iterable[str]:
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and isinstance(
                instruction.argval, str):
            yield instruction.argval
    yield from (c for c in code.co_consts if isinstance(c, str))
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_reads(c)


def _slots(cls: type) -> tuple[str, ...]:
    names = vars(cls).get("__slots__", ())
    return (names,) if isinstance(names, str) else tuple(n for n in names if n != "__weakref__")


class _Fields:
    """An object and a copy of the fields the code reads (nested objects' too, to a depth), with
    the names it reads that the object did not have (``getattr(cfg, "act", "relu")``)."""

    __slots__ = ("obj", "fields", "absent")

    def __init__(self, obj: Any, fields: dict[str, Any], absent: tuple[str, ...]):
        self.obj, self.fields, self.absent = obj, fields, absent


class _Array:
    """A NumPy array and a copy of its contents."""

    __slots__ = ("obj", "copy")

    def __init__(self, obj: Any):
        self.obj, self.copy = obj, obj.copy()


def _copied(value: Any) -> bool:
    """A NumPy array :func:`kept` copies: numbers, at most :data:`ARRAY_LIMIT` elements."""
    return value.dtype.kind in "biufc" and value.size <= ARRAY_LIMIT


def kept(value: Any, names: frozenset[str] | None = None,
         unseen: list[str] | None = None) -> Any:
    """What the guard keeps of ``value``: copies of lists and dicts (nested ones too: they may
    change in place), of an object's fields named in ``names`` (all where ``None``) and of a
    NumPy array's contents; the value itself otherwise. Objects within objects are followed
    :data:`DEPTH` levels deep, and at most :data:`BUDGET` fields and items in all; what is kept
    as itself past those bounds, or as a large array, is described in ``unseen`` (a change of
    its contents will not be seen)."""
    return _kept(value, names, DEPTH, [BUDGET], [] if unseen is None else unseen)


def _kept(value: Any, names: frozenset[str] | None, depth: int, budget: list[int],
          unseen: list[str]) -> Any:
    if isinstance(value, (list, dict)) or (isinstance(value, tuple) and not plain(value)):
        if len(value) > budget[0]:
            unseen.append(f"a {type(value).__name__} of {len(value)} items")
            return value
        budget[0] -= len(value)
        if isinstance(value, list):
            return [_kept(v, names, depth, budget, unseen) for v in value]
        if isinstance(value, dict):
            return {k: _kept(v, names, depth, budget, unseen) for k, v in value.items()}
        items = [_kept(v, names, depth, budget, unseen) for v in value]
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
    # all fields where reads go through the class's own code (``cfg.scale`` served by a
    # ``__getattr__`` from a ``_content`` dict) or where the caller names none
    custom = any(n in vars(k) for k in type(value).__mro__[:-1]
                 for n in ("__getattr__", "__getattribute__"))
    wanted = None if names is None or custom else names | _class_reads(type(value))
    chosen = fields if wanted is None else {k: v for k, v in fields.items() if k in wanted}
    if len(chosen) > budget[0]:
        unseen.append(f"a {type(value).__name__} of {len(chosen)} fields")
        return value
    budget[0] -= len(chosen)
    absent = () if wanted is None else tuple(sorted(n for n in wanted if n not in fields))
    return _Fields(value, {k: _kept(v, names, depth - 1, budget, unseen)
                           for k, v in chosen.items()}, absent)


def same(old: Any, new: Any) -> bool:
    """Whether ``new`` is what ``old`` (kept by :func:`kept`) was: plain values and lists or
    dicts of them by value; lists, tuples and dicts holding other objects item by item; an object
    with fields the same object with the same fields; a NumPy array the same array with the same
    contents; any other object by identity."""
    if old is new:
        return True
    if isinstance(old, _Fields):
        fields = _fields(new) if new is old.obj else None
        return fields is not None and all(
            same(v, fields.get(k, MISSING)) for k, v in old.fields.items()) and not any(
            map(fields.__contains__, old.absent))
    if isinstance(old, _Array):
        return new is old.obj and _equal_arrays(new, old.copy)
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
