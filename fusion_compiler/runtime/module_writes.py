"""What tracing must leave as it was: ``torch.fx`` runs ``forward``'s Python code on proxies, so
``self.count += 1`` (an int), ``self.n += 1`` (a buffer: the proxy of the add is assigned) or
``self.stats.calls += 1`` (a field of an object the module holds) would change the model at trace
time, once, and a compiled graph cannot repeat such an assignment at each call.
:class:`ModuleWrites` saves the model's tables before the trace, puts them back after it and says
what the traced code assigned (the capture then refuses the model in one line)."""

from __future__ import annotations

from typing import Any

import torch

from .snapshots import MISSING, fields_of, same

__all__ = ["ModuleWrites"]


class ModuleWrites:
    """The attributes, parameters, buffers and submodules of every module of ``model`` as they
    are now, and the fields of the objects with fields they hold (a config or statistics object,
    one level down), for :meth:`restore` after tracing."""

    def __init__(self, model: torch.nn.Module):
        self._saved = [(path, [(d, dict(d)) for d in (vars(m), m._parameters, m._buffers,
                                                      m._modules)])
                       for path, m in model.named_modules()]
        self._objects: list[tuple[str, Any, dict[str, Any]]] = []
        seen: set[int] = set()
        for path, m in model.named_modules():
            for name, value in vars(m).items():
                fields = fields_of(value) if id(value) not in seen else None
                if fields is not None:
                    seen.add(id(value))
                    self._objects.append((f"{path}.{name}" if path else name, value, fields))

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
                       if now.get(n, MISSING) is not saved.get(n, MISSING)]
            assigned += [f"{path}.{n}" for n in changed]
            for n in changed:  # put back (a field the trace added is deleted)
                try:
                    if n in saved:
                        object.__setattr__(obj, n, saved[n])
                    else:
                        object.__delattr__(obj, n)
                except (AttributeError, TypeError):  # a read-only field: left as it is
                    pass
        return sorted(set(assigned))
