"""What a trace reads of the model's Python objects, recorded while it runs: the attribute names
read on each module whose code the trace runs, and the names read on each object that holds
data in fields (a config object: a dataclass, ``argparse.Namespace``, any instance with a
``__dict__`` or ``__slots__``; :func:`fusion_compiler.runtime.snapshots.field_holders`) that the
model's modules, their classes or the module-level names its code reads hold.

For the trace, each such object's class gets a ``__getattribute__`` that notes the name read on
those objects (by identity) and then reads as before. Every attribute read of a Python object
goes through it: in ``forward``, in a method or property of the object, in ``getattr`` with a
name built at run time, ``operator.attrgetter``, ``vars(obj)`` (a read of ``__dict__``),
``copy`` and ``dataclasses`` helpers. The objects keep their class (``type(self) is Block``
sees what it sees when the code runs). Left out, their objects' fields all compared as where
nothing was recorded: classes that cannot take the method or whose reads may pass it
(:func:`_recordable`: types of C code such as ``types.SimpleNamespace`` and their subclasses,
classes with ``__getattr__`` or a ``__getattribute__`` of their own), objects that ``torch.nn``'s
modules hold (their ``forward`` reads them when it runs, not in the trace) and objects the
traced graph holds as constants (:meth:`Reads.forget_constants`). What
:class:`~fusion_compiler.runtime.state.StateGuard` makes of the names:
:mod:`fusion_compiler.runtime.snapshots`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .runtime.snapshots import MODULE_INTERNALS, field_holders

__all__ = ["Reads", "recording_reads"]

log = logging.getLogger("fusion_compiler")


@dataclass
class Reads:
    """The names a trace read: ``modules`` maps each module whose code it ran to the attribute
    names read on it; ``fields`` maps ``id(obj)`` to ``(obj, names read on it)`` for each object
    with fields whose reads were recorded (those of a class that took the recorder)."""

    modules: dict[torch.nn.Module, set[str]] = field(default_factory=dict)
    fields: dict[int, tuple[Any, set[str]]] = field(default_factory=dict)
    memoized: bool = False
    """The trace may have read a value a cache computed earlier (:meth:`forget_if_memoized`):
    no record of this model's fields is to be trusted."""

    def forget_if_memoized(self, global_values: Iterable[Any]) -> None:
        """Drop every field record, and set :attr:`memoized`, where the traced code may have
        called a memoized function (``functools.cache``/``lru_cache``, ``cachetools``; a global
        the code reads, or a method a recorded name found): a cache hit returns a value computed
        from fields the trace never read (a review of session 39 found it)."""
        found = [*global_values]
        for obj, names in [*self.modules.items(), *self.fields.values()]:
            found += [vars(k)[n] for n in names for k in type(obj).__mro__ if n in vars(k)]
        if any(map(_memoizing, found)):
            self.memoized = True
            self.fields.clear()

    def forget_constants(self, graph: fx.Graph) -> None:
        """Drop the records of the objects the traced ``graph`` holds as constants (an argument
        of a node, or within one): the op reads them when it runs, not during the trace, so
        every field of theirs is compared."""
        constants = [a for node in graph.nodes for a in pytree.tree_leaves((node.args,
                                                                             node.kwargs))
                     if not isinstance(a, fx.Node)]
        for obj in field_holders(constants):
            self.fields.pop(id(obj), None)


@contextlib.contextmanager
def recording_reads(model: torch.nn.Module, roots: Iterable[Any] = ()) -> Iterator[Reads]:
    """Record, for the block, the attribute names read on each module of ``model`` whose code
    the trace runs (all but ``torch.nn``'s own, which fx keeps as leaves) and the names read on
    each object with fields held by ``model``'s modules, by their classes or by ``roots`` (the
    values of the module-level names the code reads), see the module docstring. A module whose
    class cannot take the recorder is left out of :attr:`Reads.modules`, an object's of
    :attr:`Reads.fields`. Traces record one at a time (a lock): two threads patching one class
    would leave it patched."""
    with _RECORDING:
        yield from _recording(model, roots)


_RECORDING = threading.RLock()


def _held(modules: list[torch.nn.Module]) -> list[Any]:
    """The values the modules hold that the guard may keep: their own attributes (not
    ``nn.Module``'s bookkeeping) and the values of their classes (not torch's)."""
    values = [v for m in modules for n, v in vars(m).items() if n not in MODULE_INTERNALS]
    classes = dict.fromkeys(k for m in modules for k in type(m).__mro__
                            if k is not object and not k.__module__.startswith("torch."))
    return values + [v for k in classes for v in vars(k).values()]


def _memoizing(value: Any) -> bool:
    """A callable that keeps results between calls: what ``functools.cache`` and ``lru_cache``
    return (``cache_info``), ``cachetools``' decorators (``cache_clear``, ``cache``)."""
    return callable(value) and any(hasattr(value, a) for a in ("cache_info", "cache_clear",
                                                                "cache_parameters"))


def _recordable(cls: type) -> bool:
    """Whether every read of an instance's fields goes through its class's
    ``__getattribute__``: classes of Python code only (no base of C code whose methods read the
    state directly: a subclass of ``types.SimpleNamespace``), with no ``__getattr__`` and no
    ``__getattribute__`` of their own (those usually fetch their storage with
    ``object.__getattribute__``, past the recorder; ``functools.partial`` has one). A review of
    session 39 found each."""
    heap = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement
    return (all(k.__flags__ & heap for k in cls.__mro__[:-1])
            and cls.__getattribute__ is object.__getattribute__
            and getattr(cls, "__getattr__", None) is None)


def _recording(model: torch.nn.Module, roots: Iterable[Any]) -> Iterator[Reads]:
    reads = Reads()
    tables: dict[type, dict[int, set[str]]] = {}
    modules = list(dict.fromkeys(model.modules()))
    for module in modules:
        if not type(module).__module__.startswith("torch."):
            tables.setdefault(type(module), {})[id(module)] = reads.modules.setdefault(
                module, set())
    # what torch's modules hold their forward reads when it runs (a leaf's activation object),
    # not during the trace: not recorded, every field compared
    run_time = {id(o) for o in field_holders(
        [v for m in modules if type(m).__module__.startswith("torch.")
         for n, v in vars(m).items() if n not in MODULE_INTERNALS])}
    for obj in field_holders([*_held(modules), *roots]):
        if id(obj) in run_time or not _recordable(type(obj)):
            continue
        names: set[str] = set()
        reads.fields[id(obj)] = (obj, names)
        tables.setdefault(type(obj), {})[id(obj)] = names
    patched = []
    for cls, table in tables.items():
        own = vars(cls).get("__getattribute__")
        read = cls.__getattribute__  # what its instances run now (its own or inherited)

        def __getattribute__(self: Any, name: str, _table: dict = table,
                             _read: Any = read) -> Any:
            names = _table.get(id(self))
            if names is not None:
                names.add(name)
            return _read(self, name)

        try:
            cls.__getattribute__ = __getattribute__
            if vars(cls).get("__getattribute__") is not __getattribute__:
                raise TypeError("the metaclass ignored the assignment")
        except Exception:  # noqa: BLE001 (a type of C code, or a metaclass that refuses)
            for module in [m for m in reads.modules if type(m) is cls]:
                del reads.modules[module]
            for key in [k for k, (obj, _) in reads.fields.items() if type(obj) is cls]:
                del reads.fields[key]
            continue
        patched.append((cls, own))
    try:
        yield reads
    finally:
        for cls, own in reversed(patched):
            try:
                if own is None:
                    del cls.__getattribute__
                else:
                    cls.__getattribute__ = own
            except Exception:  # noqa: BLE001 (a metaclass that refuses: the others put back)
                log.warning("could not take the attribute recorder off %s after a trace: its "
                            "attribute reads stay slower", cls.__qualname__)
