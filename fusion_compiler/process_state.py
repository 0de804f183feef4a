"""Values a ``forward`` may read that a trace reads once: what :func:`read_once` tells apart.

``torch.fx`` runs ``forward``'s Python code once; whatever that code reads besides the traced
tensors becomes a constant of the graph. The package guards the module's attributes, the globals
the code reads, the modules' ``training`` flags, grad mode and autocast (docs/decisions.md,
"Python-level state: guarded, assignments refused, tracing leaves the model alone"). What is
left, read through a global name, an imported module's attribute, a closure, a module
attribute or an import inside the code (:func:`~fusion_compiler.code_reads.globals_read` finds
them in the bytecode), falls in four kinds:

* ``"random"``: Python's or NumPy's random numbers (:func:`~.random_ops.python_random`): the
  numbers of the trace would come back at every call, so :func:`~fusion_compiler.capture.capture`
  refuses them where the trace drew them;
* ``"grad"``: ``torch.is_grad_enabled`` bound to another name (``from torch import
  is_grad_enabled``): the tracer answers ``torch.is_grad_enabled`` itself, not an alias, so the
  capture treats the alias as a read of grad mode (a specialization per mode);
* ``"state"``: process-wide state that calls may change and a traced graph keeps as it was when
  traced: environment variables, the clock (``time.time()``), torch's default dtype, its
  deterministic-algorithms and anomaly-detection modes, float32 matmul precision, thread count,
  ``torch.backends`` flags, a ``threading.local`` or a ``contextvars.ContextVar``. The capture
  says so in one WARNING;
* ``"iterator"``: an iterator the code reads by a module-level name (``next(STEPS)`` over an
  ``itertools.count``, a generator): the trace would take one item, for every call, and the
  iterator's place cannot be compared or put back, so the capture refuses it.
"""

from __future__ import annotations

import collections.abc
import contextvars
import io
import os
import threading
import time
import types
from typing import Any

import torch

from .random_ops import python_random

__all__ = ["read_once"]


def _state_functions() -> dict[int, str]:
    named = {
        "os.environ": os.environ, "os.getenv": os.getenv,
        "torch.get_default_dtype": torch.get_default_dtype,
        "torch.are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled,
        "torch.get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "torch.is_anomaly_enabled": torch.is_anomaly_enabled,
        "torch.get_num_threads": torch.get_num_threads,
        "torch.backends": torch.backends,
        "time.time": time.time, "time.time_ns": time.time_ns, "time.monotonic": time.monotonic,
        "time.perf_counter": time.perf_counter, "time.process_time": time.process_time,
    }
    return {id(v): k for k, v in named.items()}


_STATE = _state_functions()


def read_once(value: Any) -> tuple[str, str] | None:
    """``(kind, what)`` for a value ``forward``'s code reads that a trace reads once (kinds in
    the module docstring), ``None`` for any other value."""
    if python_random(value):
        return "random", ""
    if value is torch._C.is_grad_enabled:
        return "grad", "torch.is_grad_enabled"
    name = _STATE.get(id(value))
    if name is None and isinstance(value, types.MethodType) and (
            value.__self__ is os.environ):  # os.environ.get
        name = "os.environ"
    if name is None and isinstance(value, types.ModuleType) and (
            value.__name__.startswith("torch.backends.")):
        name = value.__name__
    if name is None and isinstance(value, threading.local):
        name = "a threading.local"
    if name is None and isinstance(value, contextvars.ContextVar):
        name = f"the context variable {value.name!r}"
    if name is None and isinstance(value, collections.abc.Iterator) and not isinstance(
            value, (torch.Tensor, io.IOBase)):
        return "iterator", type(value).__name__
    return ("state", name) if name is not None else None
