"""A compiled module as the model it wraps: ``compiled.state_dict()`` has the model's keys (no
``model.`` prefix) and loads into the model it came from, the model's state dict loads into the
compiled module, and the model's public attributes and methods are read through it
(:class:`ModelAttributes`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ModelAttributes", "model_keys", "prefixed_keys"]


class ModelAttributes:
    """Mixin for an ``nn.Module`` that wraps another as its submodule ``model``: a public
    attribute it does not have itself is the model's (``compiled.fc``, ``compiled.num_classes``;
    a method other than ``forward``, such as an agent's ``act``, runs the model's own code,
    uncompiled), as ``torch.compile``'s module reads its original's. Names starting with ``_``
    are not looked up in the model: PyTorch's own probes (DDP's, Dynamo's) see the wrapper.
    Once :meth:`_forward_attributes` was called (at the end of the wrapper's ``__init__``), a
    public attribute set or deleted that the wrapper does not hold itself (nor its class, nor
    ``training``) is set on or deleted from the model (``compiled.temperature = 0.5``,
    ``compiled.fc = nn.Linear(...)``), as ``torch.compile``'s module does: forward reads the
    model's.

    Raises:
        AttributeError: neither module has the attribute (the model's message)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]  (nn.Module's)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("_"):
                raise
            return getattr(model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        model = self._model_for(name)
        if model is not None:
            setattr(model, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        model = self._model_for(name)
        if model is not None:
            delattr(model, name)
        else:
            super().__delattr__(name)

    def _forward_attributes(self) -> None:
        object.__setattr__(self, "_forwarding", True)

    def _model_for(self, name: str) -> Any:
        """The model, where an attribute ``name`` set on the wrapper belongs to it, else None."""
        own = self.__dict__
        if not own.get("_forwarding") or name.startswith("_") or name == "training" or (
                name in own or hasattr(type(self), name)
                or any(name in own.get(table, ()) for table in ("_parameters", "_buffers",
                                                                  "_modules"))):
            return None
        return own["_modules"].get("model")


def model_keys(module: torch.nn.Module, state: dict, prefix: str, metadata: dict) -> None:
    """A state dict hook: the model's keys without the ``model.`` its compiled module adds, so
    that ``compiled.state_dict()`` loads into the model it came from (and back)."""
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        for key in [k for k in meta if k == inner[:-1] or k.startswith(inner)]:
            meta[prefix + key[len(inner):] if key != inner[:-1] else prefix[:-1]] = meta.pop(key)


def prefixed_keys(module: torch.nn.Module, state: dict, prefix: str, *args: Any) -> None:
    """A load-state-dict pre-hook: keys of the model (as :func:`model_keys` gives them) are
    read as the compiled module's own."""
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix):]] = state.pop(key)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        for key in [k for k in meta if (k + ".").startswith(prefix) and not
                    (k + ".").startswith(inner)]:
            rest = (key + ".")[len(prefix):-1]
            meta[inner + rest if rest else inner[:-1]] = meta[key]
