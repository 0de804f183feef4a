"""Tensor attributes a trace reads as Python values (``self.k.item()``, ``float(self.k)``,
``self.w.tolist()``, ``if self.flag:``): a plain tensor attribute (not a parameter or buffer,
which the trace reads as graph inputs) is a real tensor in the trace, so the value read is a
constant of the graph. Changed in place later (``model.k.fill_(5.0)``), the compiled calls kept
the trace's value (2.9 off, helper-57); the guard compares these tensors' contents at each call
(:class:`~.runtime.state.StateGuard`) and the model compiles again when they change."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

__all__ = ["values_read"]

_READERS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__complex__")
_LOCK = threading.Lock()  # (one patching at a time: traces hold the trace lock anyway)


@contextlib.contextmanager
def values_read(model: torch.nn.Module) -> Iterator[list[tuple[dict, str]]]:
    """While the block runs on this thread, record which plain tensor attributes of ``model``'s
    modules the code converts to Python values: ``(the module's __dict__, name)``, once each."""
    held = {id(t): (vars(m), n) for m in model.modules() for n, t in vars(m).items()
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)}
    found: list[tuple[dict, str]] = []
    if not held:
        yield found
        return
    thread = threading.get_ident()
    originals = {name: vars(torch.Tensor).get(name) for name in _READERS}

    def reader(name: str) -> Any:
        base = getattr(torch._C.TensorBase, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = held.get(id(self))
            if where is not None and threading.get_ident() == thread and where not in found:
                found.append(where)
            return base(self, *args, **kwargs)
        return read

    with _LOCK:
        for name in _READERS:
            setattr(torch.Tensor, name, reader(name))
        try:
            yield found
        finally:
            for name, original in originals.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)
