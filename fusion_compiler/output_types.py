"""The container types of ``forward``'s output that a traced graph loses, put back on each
call's output: fx writes every dict of the output as a ``dict`` and a tuple of a class of the
user's as a ``tuple`` (``collections.OrderedDict``, as torchvision's segmentation models return,
came back a ``dict``: ``out.move_to_end`` failed). Named tuples keep their class in fx.
"""

from __future__ import annotations

import collections
from typing import Any

import torch.fx as fx

__all__ = ["OutputRecorder", "skeleton", "rebuilt"]


class OutputRecorder:
    """Tracer mixin: :attr:`last_output` is the last value a trace made a graph argument of at
    the top level, which at the end of a trace is what ``forward`` returned (fx makes the output
    node's argument of it last), with its containers as ``forward`` made them."""

    last_output: Any = None
    _depth = 0

    def create_arg(self, a: Any) -> Any:
        self._depth += 1
        try:
            return super().create_arg(a)  # type: ignore[misc]
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.last_output = a


def skeleton(value: Any) -> Any:
    """What :func:`rebuilt` needs to give an output ``value``'s containers their classes back:
    ``None`` where a value and everything in it are plain (dicts, lists, tuples, named tuples,
    other values), else ``(class, default_factory, items)``: a dict subclass, a tuple or list
    subclass (not a named tuple: fx keeps those), or a container holding one."""
    if isinstance(value, dict):
        items = {k: skeleton(v) for k, v in value.items()}
        if type(value) is dict and all(v is None for v in items.values()):
            return None
        return type(value), getattr(value, "default_factory", None), items
    if isinstance(value, (list, tuple)) and not isinstance(value, fx.Proxy):
        listed = [skeleton(v) for v in value]
        named = hasattr(type(value), "_fields")
        if (type(value) in (list, tuple) or named) and all(v is None for v in listed):
            return None
        return (type(value) if not named else None), None, listed
    return None


def rebuilt(value: Any, shape: Any) -> Any:
    """``value`` (a call's output) with the container classes ``shape`` (:func:`skeleton`)
    recorded: the same items, in an ``OrderedDict``, a ``defaultdict`` with its factory, or the
    user's dict, list or tuple class (built from the plain container); ``value`` itself where
    ``shape`` is ``None``."""
    if shape is None:
        return value
    kind, factory, items = shape
    if isinstance(items, dict):
        plain = {k: rebuilt(value[k], items.get(k)) for k in value}
        if kind is collections.defaultdict:
            made = collections.defaultdict(factory)
            made.update(plain)
            return made
        return plain if kind is dict else kind(plain)
    parts = [rebuilt(v, s) for v, s in zip(value, items)]
    if kind is None:  # a named tuple (its class kept): its items rebuilt
        return type(value)(*parts)
    return kind(parts)
