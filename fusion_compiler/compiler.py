"""``fusion_compiler.compile``: a module that computes the model's function through fused regions,
one specialization per input signature (:mod:`.specialization` builds them, :mod:`.runners` says
what their calls go through)."""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Any, Sequence

import torch

from .capture import TensorSpec, capture, input_specs
from .config import CompileOptions, Target
from .ir.errors import FusionError, InputError, InputShapeError, InputTypeError
from .runtime.tensors import restored
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
        InputTypeError: (a ``TypeError``) wrong number of inputs, or a floating input whose dtype
            differs from the model's parameters (expected and actual dtypes are in the message).
        InputError: (a ``ValueError``) an input on another device than the model's parameters,
            or of a shape the model does not take (the message names the input, its shape, the
            model's own error for it and the shapes earlier calls took). Input errors are raised
            from the call, without the compiler's frames or chained errors.
        FusionError: the graph breaks the cuDNN graph rules.
    """

    def __init__(self, model: torch.nn.Module, options: CompileOptions | None = None,
                 **kwargs: Any):
        super().__init__()
        self.options = CompileOptions.from_kwargs(options, **kwargs)
        self.model = model
        self._arity = len(capture(model).graph.find_nodes(op="placeholder"))  # fail early
        # read at every call: the parameter objects stay (``.to()``/``.half()`` change their data)
        self._model_params = tuple(model.parameters())
        self._dtype_ref = next((p for p in self._model_params if p.is_floating_point()), None)
        self.specializations: collections.OrderedDict[tuple, Specialization] = \
            collections.OrderedDict()
        self.last: Specialization | None = None
        # reasons already logged (each once per module); a function of the set, not a method:
        # the compiler holding a method of this module would make a reference cycle
        self._noted: set[str] = set()
        self._compiler = SpecializationCompiler(model, self.options,
                                                functools.partial(_note, self._noted))

    # ------------------------------------------------------------------ checks
    def _check_inputs(self, args: Sequence[Any]) -> None:
        if len(args) != self._arity:
            plural = "" if self._arity == 1 else "s"
            raise InputTypeError(f"{type(self.model).__name__} takes {self._arity} "
                                 f"input{plural}, got {len(args)}")
        ref = self._dtype_ref
        if ref is None:
            return
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            if a.device != ref.device:
                raise InputError(f"input {i} is on {a.device} but the model's parameters are on "
                                 f"{ref.device}; move the input (or the model) first")
            if a.is_floating_point() and a.dtype != ref.dtype and _autocast_dtype(args) is None:
                raise InputTypeError(f"input {i} has dtype {a.dtype} but the model's parameters "
                                     f"are {ref.dtype}; convert the input to {ref.dtype}")

    def _needs_grad(self, args: Sequence[Any]) -> bool:
        if not torch.is_grad_enabled():
            return False
        return any(p.requires_grad for p in self._model_params) or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    # ------------------------------------------------------------------ compile
    def _explained(self, exc: InputError, args: Sequence[Any]) -> Exception:
        """The error to raise for inputs the compiled graph could not take, ready to raise from
        the caller's frame: an :class:`InputError` with eager PyTorch's own message for them
        (run once, gradients off, buffers restored) and what earlier calls took, without the
        compiler's frames or chained errors; a :class:`FusionError` chained to the failure when
        eager takes them (then it is the compiler's fault, not the caller's)."""
        error: Exception = exc  # a check of ours (count, device, dtype): its message says it all
        cause = None
        if isinstance(exc, InputShapeError):
            try:
                with torch.no_grad(), restored(list(self.model.buffers())):
                    self.model(*args)
            except Exception as eager:  # the model's own error: what a user reads from eager
                error = self._input_error(args, " ".join(str(eager).split())
                                          or type(eager).__name__)
            else:
                error = FusionError(f"the compiled graph cannot run on inputs that eager "
                                    f"PyTorch takes: {exc}")
                cause = exc.__cause__
        error.__cause__, error.__suppress_context__ = cause, True
        return error.with_traceback(None) if cause is None else error

    def _input_error(self, args: Sequence[Any], why: str) -> InputError:
        """An :class:`InputError` naming the inputs, ``why`` eager rejects them and what earlier
        calls took."""
        got = ", ".join(str(s) for s in input_specs(args) if isinstance(s, TensorSpec))
        seen = [", ".join(str(s) for s in key[0] if isinstance(s, TensorSpec))
                for key in self.specializations]
        took = f"; earlier calls took {' and '.join(seen[-2:])}" if seen else ""
        what = "input 0" if len(args) == 1 else "the inputs"
        return InputError(f"{type(self.model).__name__} cannot take {what} {got}: {why}{took}")

    def specialize(self, *args: Any) -> Specialization:
        """Compile (or fetch) the specialization for inputs like ``args``, lowered now: a
        specialization that a call compiled and that still answers from tier 0 is waited for
        (option ``tiered``, docs/options.md; Inductor's tier may still be compiling).

        Raises:
            InputError: inputs the model does not take (see :class:`CompiledModule`).
        """
        try:
            spec = self._specialize(args, answer_early=False)
        except InputError as exc:
            raise self._explained(exc, args)  # noqa: B904  (its own cause, set there)
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
        """Block until every specialization's background compile (option ``tiered``,
        docs/options.md) has ended, at most ``timeout`` seconds in all, and switch those
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
        try:
            spec = self._specialize(args, answer_early=True)
        except InputError as exc:
            raise self._explained(exc, args)  # noqa: B904  (its own cause, set there)
        if spec is not self.last:  # (nn.Module.__setattr__ costs microseconds per call)
            object.__setattr__(self, "last", spec)
        return spec.run(*args)

    def report(self) -> str:
        """What the last specialization is, as text at most 100 columns wide: the summary
        ``fusion-compiler dump`` prints (convolutions and their FLOPs in regions, regions per
        backend, why regions fell back), the region table (pattern, backend, plan or reason) and
        the ops left to PyTorch, grouped by reason."""
        if self.last is None:
            return "not compiled yet: call the module once (or pass example_inputs)"
        from .tables import coverage, format_report  # noqa: PLC0415

        return format_report(coverage(self.last), type(self.model).__name__)


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


def _note(noted: set[str], notes: list[str], reason: str) -> None:
    """Record why a default was not taken on the specialization (``notes``); log it once per
    module (``noted``: the reasons it logged)."""
    notes.append(reason)
    if reason not in noted:
        noted.add(reason)
        log.info("%s", reason)
