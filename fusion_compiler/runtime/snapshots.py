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
  class): the same object, its fields copied and compared in turn (a field set in place,
  ``cfg.scale = 2.0``, changes what ``forward`` computes), nested objects up to
  :data:`DEPTH` levels and :data:`BUDGET` fields in all (larger ones by identity);
- NumPy arrays: the same object with the same contents (a copy kept);
- anything else (a tensor, a ``functools.partial``, an enum member, a function) by identity.
"""

from __future__ import annotations

import enum
import functools
import types
from typing import Any

import torch

__all__ = ["plain", "kept", "same", "order", "short", "small", "MISSING", "DEPTH", "BUDGET",
           "SMALL"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.memory_format, torch.layout)
MISSING = object()
"""Stands for a value that is not there (an attribute deleted)."""
DEPTH = 4
"""Levels of objects within objects whose fields :func:`kept` keeps."""
BUDGET = 256
"""Fields of objects :func:`kept` keeps for one value, in all (a logger or an environment a
forward reads holds far more; it is compared by identity)."""
_OPAQUE = (torch.nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, functools.partial, enum.Enum)


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
    return type(value).__name__ == "ndarray" and type(value).__module__ == "numpy"


def _fields(value: Any) -> dict[str, Any] | None:
    """The fields of an object that holds data (``vars()``, or its ``__slots__``); ``None`` for
    other objects."""
    if isinstance(value, _OPAQUE) or plain(value) or isinstance(value, (list, tuple, dict)):
        return None
    found = getattr(value, "__dict__", None)
    if isinstance(found, dict):
        return found
    names = [n for k in type(value).__mro__ for n in _slots(k)]
    return {n: getattr(value, n, MISSING) for n in names} if names else None


def _slots(cls: type) -> tuple[str, ...]:
    names = vars(cls).get("__slots__", ())
    return (names,) if isinstance(names, str) else tuple(n for n in names if n != "__weakref__")


class _Fields:
    """An object and a copy of its fields (nested objects' fields too, to a depth)."""

    __slots__ = ("obj", "fields")

    def __init__(self, obj: Any, fields: dict[str, Any]):
        self.obj, self.fields = obj, fields


class _Array:
    """A NumPy array and a copy of its contents."""

    __slots__ = ("obj", "copy")

    def __init__(self, obj: Any):
        self.obj, self.copy = obj, obj.copy()


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


def kept(value: Any) -> Any:
    """What the guard keeps of ``value``: copies of lists and dicts (nested ones too: they may
    change in place), of an object's fields and of a NumPy array's contents; the value itself
    otherwise. Objects within objects are followed :data:`DEPTH` levels deep, and at most
    :data:`BUDGET` fields in all; beyond that an object is kept as itself (compared by
    identity)."""
    return _kept(value, DEPTH, [BUDGET])


def _kept(value: Any, depth: int, budget: list[int]) -> Any:
    if isinstance(value, list):
        return [_kept(v, depth, budget) for v in value]
    if isinstance(value, dict):
        return {k: _kept(v, depth, budget) for k, v in value.items()}
    if isinstance(value, tuple) and not plain(value):  # holding objects: their items kept
        return tuple(_kept(v, depth, budget) for v in value)
    if _array(value):
        return _Array(value)
    fields = _fields(value) if depth > 0 else None
    if fields is None or len(fields) > budget[0]:
        return value
    budget[0] -= len(fields)
    return _Fields(value, {k: _kept(v, depth - 1, budget) for k, v in fields.items()})


def same(old: Any, new: Any) -> bool:
    """Whether ``new`` is what ``old`` (kept by :func:`kept`) was: plain values and lists or
    dicts of them by value; lists, tuples and dicts holding other objects item by item; an object
    with fields the same object with the same fields; a NumPy array the same array with the same
    contents; any other object by identity."""
    if old is new:
        return True
    if isinstance(old, _Fields):
        fields = _fields(new) if new is old.obj else None
        return fields is not None and fields.keys() == old.fields.keys() and all(
            same(v, fields[k]) for k, v in old.fields.items())
    if isinstance(old, _Array):
        return new is old.obj and new.shape == old.copy.shape and bool((new == old.copy).all())
    if (plain(old) or _container(old)) and type(old) is type(new):
        return old == new
    if isinstance(old, (list, tuple)) and type(old) is type(new) and len(old) == len(new):
        return all(map(same, old, new))
    if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
        return all(same(v, new[k]) for k, v in old.items())
    return False


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
