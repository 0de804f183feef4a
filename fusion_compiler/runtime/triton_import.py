"""Triton imported once per process, by one thread at a time."""

from __future__ import annotations

import threading

from ..ir.errors import condense

__all__ = ["triton_import_error"]

_LOCK = threading.Lock()
_ANSWER: list[str] = []  # the one answer, once known


def triton_import_error() -> str:
    """Why Triton does not import here, as one line (``""``: it imports): the one test of it
    that the kernel loaders (:func:`fusion_compiler.kernels.load_kernel`), the derivation kernels,
    the backends and passes and the glue's Inductor check consult before importing any Triton
    module. The first call imports Triton, under a lock: two threads importing Triton at once can
    each be handed a module the other has half imported (Python's import system breaks the
    would-be deadlock of a package whose modules import each other that way: "cannot import name
    ... from partially initialized module"), and the answer is kept for the process."""
    with _LOCK:
        if not _ANSWER:
            try:
                import triton  # noqa: F401, PLC0415
                import triton.language  # noqa: F401, PLC0415
            except Exception as exc:  # ImportError, or a broken install
                _ANSWER.append(condense(f"{type(exc).__name__}: {exc}", limit=200))
            else:
                _ANSWER.append("")
        return _ANSWER[0]
