"""``fusion_compiler.compile``: a module that computes the model's function through fused regions,
one specialization per input signature (:mod:`.specialization` builds them, :mod:`.runners` says
what their calls go through)."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Sequence

import torch

from .capture import TensorSpec, capture, input_specs
from .config import CompileOptions, Target
from .runtime.tiered import TieredRunner
from .specialization import Specialization, SpecializationCompiler

__all__ = ["compile", "CompiledModule", "Specialization"]

log = logging.getLogger("fusion_compiler")


def _autocast_dtype(args: Sequence[Any]) -> torch.dtype | None:
    """The ``torch.autocast`` dtype active for the device of the first tensor input, or ``None``."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


class CompiledModule(torch.nn.Module):
    """What :func:`compile` returns: computes ``model``'s function through fused regions.

    It shares ``model``'s parameters and buffers (``parameters()``, ``state_dict()`` and
    ``train()``/``eval()`` act on the model). A call whose inputs differ in shape, stride, dtype or
    device from every earlier one compiles a new specialization (``specializations`` lists them,
    the least recently used evicted beyond ``options.max_specializations``). A call under
    ``torch.autocast`` gets its own specialization in which the autocast casts are explicit graph
    ops, so regions form in the autocast dtype. Calls that need gradients (grad mode on and a
    parameter or input requiring grad) get their own training specialization, whose regions run
    a fused backward (:mod:`fusion_compiler.autograd.backward`). ``options``: a
    :class:`~fusion_compiler.config.CompileOptions`, or its fields as keyword arguments.

    Raises (on construction):
        FusionError: the model cannot be traced.
        TypeError, ValueError: an unknown or invalid option.

    Raises (on call):
        TypeError: wrong number of inputs, or a floating input whose dtype differs from the
            model's parameters (expected and actual dtypes are in the message).
        ValueError: an input on another device than the model's parameters, or of a shape the
            model does not take.
        FusionError: the graph breaks the cuDNN graph rules.
    """

    def __init__(self, model: torch.nn.Module, options: CompileOptions | None = None,
                 **kwargs: Any):
        super().__init__()
        self.options = CompileOptions.from_kwargs(options, **kwargs)
        self.model = model
        self._arity = len(capture(model).graph.find_nodes(op="placeholder"))  # fail early
        self.specializations: collections.OrderedDict[tuple, Specialization] = \
            collections.OrderedDict()
        self.last: Specialization | None = None
        self._noted: set[str] = set()  # reasons already logged (each once per module)
        self._compiler = SpecializationCompiler(model, self.options, self._note)

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, args: Sequence[Any]) -> None:
        if len(args) != self._arity:
            raise TypeError(f"expected {self._arity} inputs, got {len(args)}")
        ref = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        if ref is None:
            return
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            if a.device != ref.device:
                raise ValueError(f"input {i} is on {a.device} but the model's parameters are on "
                                 f"{ref.device}; move the input (or the model) first")
            if a.is_floating_point() and a.dtype != ref.dtype and _autocast_dtype(args) is None:
                raise TypeError(f"input {i} has dtype {a.dtype} but the model's parameters are "
                                f"{ref.dtype}; convert the input to {ref.dtype}")

    def _needs_grad(self, args: Sequence[Any]) -> bool:
        if not torch.is_grad_enabled():
            return False
        return any(p.requires_grad for p in self.model.parameters()) or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    def _note(self, notes: list[str], reason: str) -> None:
        """Record why a default was not taken on the specialization; log it once per module."""
        notes.append(reason)
        if reason not in self._noted:
            self._noted.add(reason)
            log.info("%s", reason)

    # ------------------------------------------------------------------ compile
    def specialize(self, *args: Any) -> Specialization:
        """Compile (or fetch) the specialization for inputs like ``args``, lowered now: a
        specialization that a call compiled and that still answers from tier 0 is waited for
        (see ``tiered`` in :func:`compile`; Inductor's tier may still be compiling)."""
        spec = self._specialize(args, answer_early=False)
        if not spec.lowered and isinstance(spec.run, TieredRunner):
            spec.run.wait(nested=False)
        return spec

    def _specialize(self, args: Sequence[Any], answer_early: bool) -> Specialization:
        """The specialization for inputs like ``args``, compiled if there is none; with
        ``answer_early`` (a call) it may answer from tier 0 until lowered."""
        self._check_inputs(args)
        grad = self._needs_grad(args)
        requires = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        amp = _autocast_dtype(args)
        key = (input_specs(args), self.model.training, grad, requires if grad else (), amp)
        spec = self.specializations.get(key)
        if spec is not None:
            self.specializations.move_to_end(key)
            return spec
        log.info("compiling %s for inputs %s", type(self.model).__name__,
                 ", ".join(str(s) for s in key[0] if isinstance(s, TensorSpec)))
        target = Target(cuda=any(isinstance(a, torch.Tensor) and a.is_cuda for a in args),
                        training=grad, autocast=amp)
        spec = self._compiler.build(args, key, target, requires, answer_early)
        self.specializations[key] = spec
        while len(self.specializations) > self.options.max_specializations:
            old_key, old = self.specializations.popitem(last=False)
            old.close()
            log.info("evicted the specialization for inputs %s (max_specializations=%d)",
                     ", ".join(str(s) for s in old_key[0] if isinstance(s, TensorSpec)),
                     self.options.max_specializations)
        return spec

    def wait_for_background_compiles(self, timeout: float | None = None) -> bool:
        """Block until every specialization's background compile (see ``tiered`` in
        :func:`compile`) has ended, at most ``timeout`` seconds in all, and switch those
        specializations to their last tier now. Returns ``False`` if the timeout passed first.
        Benchmarks call it before timing the steady state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for spec in list(self.specializations.values()):
            if isinstance(spec.run, TieredRunner):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not spec.run.wait(left):
                    return False
        return True

    def forward(self, *args: Any) -> Any:
        self.last = self._specialize(args, answer_early=True)
        return self.last.run(*args)

    def report(self) -> str:
        """The region table of the last specialization (as the CLI dump prints it)."""
        if self.last is None:
            return "not compiled yet: call the module once (or pass example_inputs)"
        from .tables import format_regions  # noqa: PLC0415

        return format_regions(self.last.regions)


def compile(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None, *,
            options: CompileOptions | None = None, **kwargs: Any) -> CompiledModule:
    """Compile ``model`` into fused regions and return a module that computes the same function.

    Args:
        model: an ``nn.Module`` whose ``forward`` ``torch.fx.symbolic_trace`` can trace.
        example_inputs: compile for these inputs now (else on the first call).
        options: a :class:`~fusion_compiler.config.CompileOptions`; ``kwargs`` (its field names:
            ``backend``, ``cuda_graph``, ``cache_dir``, ``autotune``, ``fuse_prologue``,
            ``fuse_reduction``, ``report``, ``progress``, ``glue_backend``,
            ``max_specializations``, ``tiered``, ``concurrent_branches``) replace its fields.
            Every option, its default and what it does: ``docs/options.md``.

    The defaults on CUDA: every convolution chain a cuDNN region (the SpaceToDepth stem a Triton
    kernel) with autotuned plans, cached on disk; the ops between regions compiled by Inductor;
    the whole forward (and a training backward) replayed as a CUDA graph; the first calls
    answered at once while plans and glue compile in the background (``tiered``). On the CPU
    every region runs as PyTorch ops.

    Raises:
        FusionError: the model cannot be traced or its graph breaks the cuDNN graph rules.
        TypeError: an unknown option name, or a value of the wrong type.
        ValueError: an option value outside its choices or range.
    """
    compiled = CompiledModule(model, options, **kwargs)
    if example_inputs is not None:
        compiled.specialize(*example_inputs)
    return compiled
