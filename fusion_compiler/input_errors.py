"""The errors a compiled module raises for inputs its graph could not take: eager PyTorch's own
message where eager rejects them too, else the compiler's fault named as such."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .capture import TensorSpec, input_specs
from .ir.errors import FusionError, InputError, InputShapeError
from .runtime.tensors import restored

__all__ = ["explained", "input_error"]


def explained(exc: InputError, model: torch.nn.Module, args: Sequence[Any],
              flat: Sequence[Any], seen: Sequence[tuple]) -> Exception:
    """The error to raise for inputs the compiled graph of ``model`` could not take, ready to
    raise from the caller's frame: an :class:`InputError` with eager PyTorch's own message for
    ``args`` (run once, gradients off, buffers restored) and what earlier calls took (``seen``:
    the input specs of the specializations), without the compiler's frames or chained errors; a
    :class:`FusionError` chained to the failure when eager takes them (then it is the compiler's
    fault, not the caller's). ``flat``: the tensors of ``args`` (tuples taken apart)."""
    error: Exception = exc  # a check of ours (count, device, dtype): its message says it all
    cause = None
    if isinstance(exc, InputShapeError):
        try:
            with torch.no_grad(), restored(list(model.buffers())):
                model(*args)
        except Exception as eager:  # the model's own error: what a user reads from eager
            error = input_error(model, args, flat, seen,
                                " ".join(str(eager).split()) or type(eager).__name__)
        else:
            error = FusionError(f"the compiled graph cannot run on inputs that eager "
                                f"PyTorch takes: {exc}")
            cause = exc.__cause__
    error.__cause__, error.__suppress_context__ = cause, True
    return error.with_traceback(None) if cause is None else error


def input_error(model: torch.nn.Module, args: Sequence[Any], flat: Sequence[Any],
                seen: Sequence[tuple], why: str) -> InputError:
    """An :class:`InputError` naming the inputs, ``why`` eager rejects them and what earlier
    calls took."""
    got = ", ".join(str(s) for s in input_specs(flat) if isinstance(s, TensorSpec))
    took = [", ".join(str(s) for s in key if isinstance(s, TensorSpec)) for key in seen]
    earlier = f"; earlier calls took {' and '.join(took[-2:])}" if took else ""
    what = "input 0" if len(args) == 1 else "the inputs"
    return InputError(f"{type(model).__name__} cannot take {what} {got}: {why}{earlier}")
