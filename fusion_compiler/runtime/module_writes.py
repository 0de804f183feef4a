"""What tracing must leave as it was: ``torch.fx`` runs ``forward``'s Python code on proxies, so
``self.count += 1`` (an int), ``self.n += 1`` (a buffer: the proxy of the add is assigned) or
``self.stats.calls += 1`` (a field of an object the module holds) would change the model at trace
time, once, and a compiled graph cannot repeat such an assignment at each call; so would
``self.feats.append(y)``. :class:`ModuleWrites` saves the model's tables before the trace, puts
them back after it and says what the traced code assigned (the capture then refuses the model in
one line). A field of a held object set where it was ``None`` or absent (a lazy cache, a
``functools.cached_property``, a ``torch.distributions`` object's lazy ``probs``) is put back
without a word: the compiled graph computes the value at each call, and the output is eager's;
not where the value set is one the trace computed (``self.cache["feat"] = y.mean()``, a field
set to a tensor of the graph): eager leaves it there for the caller to read."""

from __future__ import annotations

import collections
import operator
from typing import Any, Iterable

import torch
import torch.fx

from .snapshots import MISSING, MODULE_INTERNALS, fields_of, same

__all__ = ["ModuleWrites"]


class ModuleWrites:
    """The attributes, parameters, buffers and submodules of every module of ``model`` as they
    are now, the fields of the objects with fields they hold (a config or statistics object, one
    level down) and the items of the lists, dicts and sets they hold, for :meth:`restore` after
    tracing; the same of ``extra``, ``(name shown, value)`` pairs (the module-level values
    ``forward``'s code reads: ``COUNTER[0] += 1`` on a global list)."""

    def __init__(self, model: torch.nn.Module, extra: Iterable[tuple[str, Any]] = ()):
        self._saved = [(path, [(d, dict(d)) for d in (vars(m), m._parameters, m._buffers,
                                                      m._modules)])
                       for path, m in model.named_modules()]
        self._objects: list[tuple[str, Any, dict[str, Any]]] = []
        self._containers: list[tuple[str, Any, Any]] = []
        seen: set[int] = set()
        for path, m in model.named_modules():
            for name, value in vars(m).items():
                if name not in MODULE_INTERNALS:  # nn.Module's own: in _saved
                    self._track(f"{path}.{name}" if path else name, value, seen)
        for where, value in extra:  # module-level values forward's code reads
            if not isinstance(value, (torch.nn.Module, torch.Tensor)):
                self._track(where, value, seen)

    def _track(self, where: str, value: Any, seen: set[int]) -> None:
        """Save ``value``'s fields (an object with fields) or items (:func:`_container`), and the
        items of the containers among its fields."""
        if id(value) in seen:
            return
        seen.add(id(value))
        fields = fields_of(value)
        if fields is not None:
            self._objects.append((where, value, fields))
            held = [(f"{where}.{field}", item) for field, item in fields.items()]
        else:
            held = [(where, value)]
        for label, item in held:
            if _container(item) and (item is value or id(item) not in seen):
                seen.add(id(item))
                self._containers.append((label, item, item.copy()))

    def restore(self) -> list[str]:
        """Put every module's tables and the held objects' fields back as they were and return
        what the traced code assigned a different value (``"layer1.count"``,
        ``"stats.calls"``); attributes ``torch.fx`` adds to the root for tensor constants
        (``_tensor_constant0``, copied into the graph module) are removed without a word."""
        assigned = []
        for path, tables in self._saved:
            for now, saved in tables:
                if now.keys() == saved.keys() and all(now[k] is v for k, v in saved.items()):
                    continue
                for name in now.keys() | saved.keys():
                    if not (name.startswith("_tensor_constant") and name not in saved) and \
                            not same(saved.get(name, MISSING), now.get(name, MISSING)):
                        assigned.append(f"{path}.{name}" if path else name)
                now.clear()
                now.update(saved)
        for path, obj, saved in self._objects:
            now = fields_of(obj) or {}
            changed = [n for n in now.keys() | saved.keys()
                       if not same(saved.get(n, MISSING), now.get(n, MISSING))]
            assigned += [f"{path}.{n}" for n in changed  # a lazy value set: eager's output too,
                         if saved.get(n, MISSING) not in (MISSING, None)  # unless the trace
                         or _traced(now.get(n))]  # computed it (a feature kept for the caller)
            for n in changed:  # put back (a field the trace added is deleted)
                try:
                    if n in saved:
                        object.__setattr__(obj, n, saved[n])
                    else:
                        object.__delattr__(obj, n)
                except (AttributeError, TypeError):  # a read-only field: left as it is
                    pass
        for path, container, saved in self._containers:
            if _changed(container, saved):
                assigned.append(f"{path} (items)")
            if isinstance(container, (list, collections.deque, set, dict)):
                container.clear()
                (container.extend if hasattr(container, "extend") else container.update)(saved)
            else:  # a NumPy array
                container[...] = saved
        return sorted(set(assigned))


def _container(value: Any) -> bool:
    """Whether ``value`` holds items a trace could change and :meth:`ModuleWrites.restore` can
    compare and put back: a list, deque, dict (``Counter``, ``defaultdict`` too), set or NumPy
    array."""
    return isinstance(value, (list, collections.deque, dict, set)) or (
        type(value).__name__ == "ndarray" and type(value).__module__ == "numpy")


def _changed(now: Any, saved: Any) -> bool:
    """Whether a trace changed the items of a :func:`_container` (``saved``: its copy): a set
    or dict item added where there was none is a lazy cache (a warn-once set, a memo), not a
    change, unless the trace computed its value; a ``Counter``'s new count is one."""
    if isinstance(now, (list, collections.deque)):
        return len(now) != len(saved) or any(map(operator.is_not, now, saved))
    if isinstance(now, set):
        return bool(saved - now)
    if isinstance(now, collections.Counter):
        return now != saved
    if isinstance(now, dict):
        return any(now.get(k, MISSING) is not v for k, v in saved.items()) or any(
            _traced(v) for k, v in now.items() if k not in saved)
    return not _same_array(now, saved)


def _traced(value: Any) -> bool:
    """Whether ``value`` is (or holds, one level down) a value the trace computed (an fx
    proxy): set into a held object or dict, it is eager's result for the caller to read
    (``self.cache["feat"] = y.mean()``), which a compiled graph would not set."""
    items = value.values() if isinstance(value, dict) else value if isinstance(
        value, (list, tuple)) else (value,)
    return any(isinstance(v, torch.fx.Proxy) for v in items)


def _same_array(a: Any, b: Any) -> bool:
    import numpy  # noqa: PLC0415  (an array is here only where NumPy is imported)

    return a.shape == b.shape and bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
