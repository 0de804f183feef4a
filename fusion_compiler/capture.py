"""Capture: an ``nn.Module`` becomes a ``torch.fx.GraphModule`` with tensor metadata on its nodes.

Shapes, dtypes, strides and devices are propagated with fake tensors
(``torch.fx.passes.fake_tensor_prop.FakeTensorProp``): the model is never run on real data.
After :func:`propagate_shapes` every node's ``meta["val"]`` holds a ``FakeTensor`` (or a Python
value/tuple of them for shape arithmetic and multi-output nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .errors import FusionError

__all__ = ["TensorSpec", "capture", "propagate_shapes", "input_specs", "tensor_meta"]


@dataclass(frozen=True)
class TensorSpec:
    """What a compiled graph is specialized on, for one tensor input.

    ``shape`` and ``stride`` are in elements, ``device`` is e.g. ``"cuda:0"``.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        return f"{dims}:{str(self.dtype).removeprefix('torch.')}@{self.device}"


def input_specs(args: Sequence[Any]) -> tuple:
    """The specialization key of a call: a :class:`TensorSpec` per tensor, the value otherwise."""
    return tuple(TensorSpec.of(a) if isinstance(a, torch.Tensor) else a for a in args)


def capture(model: torch.nn.Module) -> fx.GraphModule:
    """Trace ``model`` with ``torch.fx.symbolic_trace``.

    Raises:
        FusionError: the model's ``forward`` is not symbolically traceable (data-dependent
            control flow, for instance); the message carries fx's own error.
    """
    if isinstance(model, fx.GraphModule):
        return model
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        raise FusionError(
            f"torch.fx.symbolic_trace failed for {type(model).__name__}: {exc}. "
            "Use torch.compile(model, backend='fusion_compiler') for models with "
            "data-dependent control flow."
        ) from exc


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Fill ``node.meta["val"]`` for every node by running ``gm`` on fake copies of the inputs.

    Real tensors in ``example_inputs`` are converted to fake tensors with the same shape, dtype,
    strides and device; fake tensors are used as given (Dynamo passes them). Parameters and
    buffers of ``gm`` stay real and are only read for metadata.
    """
    mode = None
    for a in example_inputs:
        if isinstance(a, torch.Tensor) and hasattr(a, "fake_mode"):
            mode = a.fake_mode
            break
    if mode is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        mode.allow_non_fake_inputs = True
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and not hasattr(a, "fake_mode") else a
            for a in example_inputs]
    try:
        with mode:
            FakeTensorProp(gm, mode).propagate(*fake)
    finally:
        # Under torch.autocast, casts of parameters are cached for the rest of the autocast
        # region; the ones made here are fake and must not be reused by the real run.
        torch.clear_autocast_cache()
    return gm


def tensor_meta(node: fx.Node) -> torch.Tensor | None:
    """The fake tensor recorded on ``node`` by :func:`propagate_shapes`, or ``None``."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None
