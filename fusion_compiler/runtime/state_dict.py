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
