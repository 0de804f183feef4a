"""The conformance harness: usage patterns run through every door against eager PyTorch.

A :class:`Pattern` is a model and a script of what users do with it (calls, training steps,
optimizer updates, writes through ``.data``, ``load_state_dict``, mode switches, hooks ...). The
script runs twice on deep copies of the same model: once on the model itself (eager), once through
a door (``fusion_compiler.compile`` or ``torch.compile(backend="fusion_compiler")``), each step
calling what its :class:`Session` hands it. Both runs record the same values (outputs, inputs a
call writes, gradients), and at the end the module's state (every ``state_dict`` entry and every
gradient); :func:`check` compares them: same structure, shapes, dtypes and ``requires_grad``, values
within a tolerance that fits the dtype. A pattern one door must refuse names the error it raises
at once. Adding a pattern is one entry of :data:`PATTERNS` (see :mod:`conformance_patterns`).
"""

from __future__ import annotations

import copy
import faulthandler
import dataclasses
from typing import Any, Callable

import torch

import fusion_compiler
from fusion_compiler.ir.errors import FusionError

DOORS = ("compile", "dynamo")


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One usage pattern.

    Attributes:
        name: its id in test names.
        model: makes the model (called under a fixed seed; fp32 on the CPU).
        script: ``script(session)``: what the user does (see :class:`Session`).
        source: where the pattern comes from (an issue item, a test suite, an issue tracker).
        refused: door -> the exception type that door raises at once (the others must run).
        dynamic: ``torch.compile(dynamic=True)`` in the Dynamo door.
        tolerance: relative error allowed per value on the CPU (``max |a - e| / max |e|``).
        doors: the doors the pattern is about.
        gpu_dtype: the model's dtype in the GPU suite (fp16 unless the pattern needs fp32
            weights: mixed precision, whose gradient scaler refuses fp16 gradients).
    """

    name: str
    model: Callable[[], torch.nn.Module]
    script: Callable[["Session"], None]
    source: str
    refused: dict[str, type] = dataclasses.field(default_factory=dict)
    dynamic: bool = False
    tolerance: float = 1e-4
    doors: tuple[str, ...] = DOORS
    gpu_dtype: torch.dtype = torch.float16


class Session:
    """What a pattern's script works with, the same in both runs.

    Attributes:
        model: the module the user holds (updated in place by the script).
        run: what the user calls: the model itself, or what the door returned for it.
        device, dtype: where the model lives and its floating dtype.
        door: ``"eager"``, ``"compile"`` or ``"dynamo"``.
    """

    def __init__(self, model: torch.nn.Module, door: str, device: torch.device,
                 dtype: torch.dtype, options: dict, dynamic: bool, settle: bool):
        self.model, self.door, self.device, self.dtype = model, door, device, dtype
        self.options, self.dynamic, self._settle = options, dynamic, settle
        self.records: list[tuple[str, Any]] = []
        self._generator = torch.Generator().manual_seed(1234)
        self.run = self.wrap(model)

    def wrap(self, module: torch.nn.Module) -> Callable[..., Any]:
        """``module`` through this session's door (itself for eager)."""
        if self.door == "eager":
            return module
        if self.door == "compile":
            return fusion_compiler.compile(module, **self.options)
        return torch.compile(module, backend="fusion_compiler", dynamic=self.dynamic or None,
                             options=self.options or None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call :attr:`run`. When the session settles (the GPU suite's "last tier" runs), the
        compile door first compiles this call's specialization (its inputs, grad mode and
        autocast state: a new one would otherwise answer from tier 0) and every door waits for
        its background compiles."""
        if self._settle and self.door != "eager":
            if self.door == "compile" and hasattr(self.run, "wait_for_background_compiles"):
                try:
                    self.run.specialize(*args, **kwargs)
                except FusionError:  # a call compile() runs uncompiled (an autograd.Function)
                    pass
                self.run.wait_for_background_compiles()
            else:
                fusion_compiler.dynamo.wait_for_background_compiles()
        return self.run(*args, **kwargs)

    def x(self, *shape: int, dtype: torch.dtype | None = None, scale: float = 1.0,
          requires_grad: bool = False) -> torch.Tensor:
        """A random tensor (the same sequence in both runs), on the session's device, of the
        session's dtype unless given."""
        t = torch.randn(shape, generator=self._generator) * scale
        t = t.to(self.device, dtype or self.dtype)
        return t.requires_grad_(requires_grad)

    def record(self, name: str, value: Any) -> Any:
        """Keep ``value`` (detached copies of its tensors, with their ``requires_grad``) for the
        comparison; returns it."""
        self.records.append((name, _snapshot(value)))
        return value

    def state(self) -> None:
        """Record the module's state now: ``state_dict`` and gradients."""
        self.record("state_dict", dict(self.model.state_dict()))
        self.record("grads", {n: p.grad for n, p in self.model.named_parameters()})


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.detach().clone(), value.requires_grad, value.dtype)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_snapshot(v) for v in value)
    return value


def run(pattern: Pattern, door: str, device: torch.device, dtype: torch.dtype,
        options: dict | None = None, settle: bool = False) -> "Session":
    """``pattern``'s script through ``door``; the session's :attr:`~Session.records` end with
    the module's state."""
    torch.manual_seed(0)
    model = pattern.model().to(device, dtype)
    if door == "dynamo":
        torch._dynamo.reset()
    session = Session(copy.deepcopy(model), door, device, dtype, dict(options or {}),
                      pattern.dynamic, settle)
    try:
        pattern.script(session)
    except torch.AcceleratorError:  # a CUDA error: what every thread was doing, for the report
        faulthandler.dump_traceback(all_threads=True)
        raise
    session.state()
    return session


def check(eager: list, door: list, tolerance: float, where: str = "") -> None:
    """Raise ``AssertionError`` naming the first record in which ``door`` differs from
    ``eager``."""
    assert [n for n, _ in eager] == [n for n, _ in door], (where, [n for n, _ in door])
    for (name, want), (_, got) in zip(eager, door):
        _same(want, got, tolerance, f"{where}{name}")


def _same(want: Any, got: Any, tolerance: float, where: str) -> None:
    if isinstance(want, tuple) and len(want) == 3 and isinstance(want[0], torch.Tensor):
        assert isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], torch.Tensor), \
            f"{where}: a tensor in eager, {type(got).__name__} here"
        (w, w_grad, w_dtype), (g, g_grad, g_dtype) = want, got
        assert g.shape == w.shape, f"{where}: shape {tuple(g.shape)}, eager {tuple(w.shape)}"
        assert g_dtype == w_dtype, f"{where}: dtype {g_dtype}, eager {w_dtype}"
        assert g_grad == w_grad, f"{where}: requires_grad {g_grad}, eager {w_grad}"
        if not w.is_floating_point():
            assert torch.equal(g.cpu(), w.cpu()), f"{where}: values differ"
            return
        w64, g64 = w.double().cpu(), g.double().cpu()
        assert torch.equal(w64.isnan(), g64.isnan()), f"{where}: NaN where eager has none"
        w64, g64 = w64.nan_to_num(0.0, 0.0, 0.0), g64.nan_to_num(0.0, 0.0, 0.0)
        scale = w64.abs().max().item() if w64.numel() else 0.0
        err = (g64 - w64).abs().max().item() if w64.numel() else 0.0
        assert err <= tolerance * max(scale, 1e-6) or err <= 1e-6, \
            f"{where}: relative error {err / max(scale, 1e-12):.3g} > {tolerance:g}"
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), \
            f"{where}: keys {sorted(got) if isinstance(got, dict) else got}, eager {sorted(want)}"
        for k in want:
            _same(want[k], got[k], tolerance, f"{where}.{k}")
        return
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), \
            f"{where}: {type(got).__name__} of {len(got)}, eager {len(want)}"
        for i, (a, b) in enumerate(zip(want, got)):
            _same(a, b, tolerance, f"{where}[{i}]")
        return
    assert got == want, f"{where}: {got!r}, eager {want!r}"
