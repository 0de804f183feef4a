"""``fusion_compiler.compile``: a module that computes the model's function through fused regions,
one specialization per input signature (:mod:`.specialization` builds them, :mod:`.runners` says
what their calls go through)."""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import logging
import time
from typing import Any, Sequence

import torch
from torch.fx import _symbolic_trace

from .backends import check_backends
from .capture import (TensorSpec, capture, flatten_inputs, input_specs, unpacked_inputs,
                      untrainable)
from .config import CompileOptions, Target
from .grad_modes import GradFacts, GradFactsByFlags
from .ir.errors import FusionError, InputError, InputTypeError
from .ir.ops import writes_in_place
from .input_errors import explained
from .output_types import rebuilt
from .parametrized_calls import in_cached_block
from .runners import note_once
from .runtime.background import warn_once
from .runtime.hooks import call_with_hooks, has_hooks, uncompiled_forward, unsupported_hook
from .runtime.recompiles import Recompiles
from .runtime.state import StateGuard
from .runtime.state_dict import ModelAttributes, model_keys, prefixed_keys
from .runtime.tensors import autocast_dtype, on_device_of, shared_storage
from .runtime.tiered import TieredRunner
from .specialization import Specialization, SpecializationCompiler

__all__ = ["compile", "CompiledModule", "Specialization"]

log = logging.getLogger("fusion_compiler")


class CompiledModule(ModelAttributes, torch.nn.Module):
    """What :func:`compile` returns: computes ``model``'s function through fused regions.

    It shares ``model``'s parameters and buffers (``parameters()``, ``state_dict()`` and
    ``train()``/``eval()`` act on the model); the model's public attributes and other methods are
    read through it (they run uncompiled). A call whose inputs differ in shape, stride, dtype or
    device from every earlier one compiles a new specialization (``specializations`` lists them, the
    least recently used evicted beyond ``options.max_specializations``). A call under
    ``torch.autocast`` gets its own specialization in which the autocast casts are explicit graph
    ops, so regions form in the autocast dtype; a call inside ``torch.inference_mode()`` gets its
    own (its outputs are inference tensors, as eager's are). Calls that need gradients (grad mode on
    and a parameter or input requiring grad) get their own training specialization, whose regions
    run a fused backward (:mod:`fusion_compiler.autograd.backward`). ``options``: a
    :class:`~fusion_compiler.config.CompileOptions`, or its fields as keyword arguments.

    Raises (on construction):
        FusionError: the model cannot be traced.
        TypeError, ValueError: an unknown or invalid option (also a ``backends`` name no
            backend is registered under).

    Raises (on call):
        InputTypeError: (a ``TypeError``) a wrong number of inputs, or keyword arguments
            ``forward`` does not take (Python's own message).
        InputError: (a ``ValueError``) an input on another device than the model's parameters,
            or of a shape or dtype the model does not take (the message names the input, its
            shape, the model's own error for it and the shapes earlier calls took). Input errors
            are raised from the call, without the compiler's frames or chained errors.
        FusionError: the graph breaks the cuDNN graph rules, or a hook below the root (or a
            global module hook) would not be called by the compiled graph (the message names
            it; the root's own hooks run as ``nn.Module.__call__`` runs them).
    """

    def __init__(self, model: torch.nn.Module, options: CompileOptions | None = None,
                 **kwargs: Any):
        super().__init__()
        self.options = CompileOptions.from_kwargs(options, **kwargs)
        check_backends(self.options.backends)
        model = _unwrapped(model)
        self.model = model
        captured = capture(model)  # fail early
        self._names = [n.target for n in captured.graph.find_nodes(op="placeholder")]
        self._arity = len(self._names)
        self._writes = any(map(writes_in_place, captured.graph.nodes))
        self._unpacked = unpacked_inputs(captured)  # where a tuple input is taken apart
        self._untrainable = untrainable(captured, type(model).__name__)
        self._grad_facts = GradFactsByFlags(lambda: capture(model))  # (per training flags)
        try:
            self._signature: inspect.Signature | None = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self._signature = None
        self.register_state_dict_post_hook(model_keys)
        self.register_load_state_dict_pre_hook(prefixed_keys)
        self._guard = StateGuard(model, captured)  # (the state the graph writes: _call)
        self._grad_facts.seed(self._guard.training_flags(), captured)
        self._take_state()
        self.specializations: collections.OrderedDict = collections.OrderedDict()  # key: spec
        self.last: Specialization | None = None
        # reasons logged, once per module (a function of the set: a method would make a cycle)
        self._noted: set[str] = set()
        self._recompiles = Recompiles(type(model).__name__)
        self._compiler = SpecializationCompiler(model, self.options,
                                                functools.partial(note_once, self._noted),
                                                self._names)
        self._forward_attributes()  # from now on, new public attributes are the model's

    def __prepare_scriptable__(self) -> torch.nn.Module:
        """``torch.jit.script`` scripts the model (TorchScript runs its own code)."""
        return self.model

    def __reduce__(self) -> tuple:
        """Pickled (``torch.save``) as its model and options: loading compiles again."""
        return CompiledModule, (self.model, self.options)

    def __deepcopy__(self, memo: dict) -> "CompiledModule":
        """A compiled module of a deep copy of the model, same options, no specialization."""
        memo[id(self)] = copied = CompiledModule(copy.deepcopy(self.model, memo), self.options)
        return copied

    def _take_state(self) -> None:
        # plain attributes: a parameter set on a module would be registered as its own
        params = tuple(self.model.parameters())
        object.__setattr__(self, "_model_params", params)
        object.__setattr__(self, "_dtype_ref",
                           next((p for p in params if p.is_floating_point()), None))

    def _check_state(self) -> None:
        """Compile again when the model's state changed as :class:`~.runtime.state.StateGuard`
        finds (a tensor or submodule replaced, a plain value forward reads set to another)."""
        if not self._guard.changed():
            return
        self._recompiles.note(self._guard.describe(), len(self.specializations))
        for spec in self.specializations.values():
            spec.close()
        self.specializations.clear()
        self._grad_facts.clear()
        object.__setattr__(self, "last", None)
        self._guard.take()
        self._take_state()

    def _check_inputs(self, args: Sequence[Any]) -> None:
        if len(args) != self._arity:
            plural = "" if self._arity == 1 else "s"
            raise InputTypeError(f"{type(self.model).__name__} takes {self._arity} "
                                 f"input{plural}, got {len(args)}")
        ref = self._dtype_ref
        for i, a in enumerate(args if ref is not None else ()):
            # a 0-d CPU tensor is a scalar every device's ops take (Dynamo passes floats so); a
            # dtype eager does not take is found by eager itself (``explained``)
            if isinstance(a, torch.Tensor) and a.device != ref.device and a.dim() > 0:
                raise InputError(f"input {i} is on {a.device} but the model's parameters are on "
                                 f"{ref.device}; move the input (or the model) first")

    def _bind(self, args: tuple, kwargs: dict) -> tuple:
        """The arguments of a call as the traced graph takes them: positional, in ``forward``'s
        order, defaults filled in, as ``forward`` would bind them.

        Raises:
            InputTypeError: ``forward`` does not take them (Python's own message)."""
        if self._signature is None:
            raise InputTypeError(f"{type(self.model).__name__}'s forward takes no keyword "
                                 f"arguments here; pass its {self._arity} inputs positionally")
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            plural = "" if self._arity == 1 else "s"
            keywords = f" and {len(kwargs)} keyword argument(s)" if kwargs else ""
            raise InputTypeError(f"{type(self.model).__name__} takes {self._arity} input{plural} "
                                 f"({', '.join(self._names)}), got {len(args)}{keywords}: "
                                 f"{exc}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def _needs_grad(self, args: Sequence[Any], facts: GradFacts | None = None) -> bool:
        """Whether a call records autograd history: grad mode on (or a block in forward that
        turns it on), no inference mode, and a parameter or input requiring grad."""
        facts = facts or self._grad_facts(self._guard.training_flags())
        if not facts.grad or torch.is_inference_mode_enabled() or not (
                torch.is_grad_enabled() or facts.enables):
            return False
        return any(p.requires_grad for p in self._model_params) or any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)

    def _explained(self, exc: InputError, args: Sequence[Any]) -> Exception:
        """The error to raise for inputs the graph could not take (:func:`~.input_errors.
        explained`)."""
        keys = [key[0] for key in self.specializations]
        return explained(exc, self.model, args, flatten_inputs(args, self._unpacked)[0], keys)

    def specialize(self, *args: Any, **kwargs: Any) -> Specialization:
        """Compile (or fetch) the specialization for a call with these arguments (bound as the call
        would bind them), under the current grad mode, inference mode and autocast state, lowered
        now: a specialization that a call compiled and that still answers from tier 0 is waited for
        (option ``tiered``, docs/options.md; Inductor's tier may still be compiling). Runs no
        forward pass: the module's state is left as it is, and the module's own forward pre-hooks
        are not called (a pre-hook that changes the inputs leaves a call to compile its own
        specialization).

        Raises:
            InputError: inputs the model does not take (see :class:`CompiledModule`).
        """
        if kwargs or len(args) != self._arity:
            args = self._bind(args, kwargs)
        with on_device_of(self._dtype_ref, args):  # (see forward)
            try:
                spec, _ = self._specialize(args, answer_early=False)
            except InputError as exc:
                raise self._explained(exc, args)  # noqa: B904  (its own cause, set there)
            if not spec.lowered and isinstance(spec.run, TieredRunner):
                spec.run.wait(nested=False)
        return spec

    def _specialize(self, args: Sequence[Any], answer_early: bool) -> tuple[Specialization, tuple]:
        """The specialization for inputs like ``args``, compiled if there is none, and the inputs
        as it takes them (tuples taken apart, :func:`~.capture.flatten_inputs`); with
        ``answer_early`` (a call) it may answer from tier 0 until lowered."""
        self._check_state()
        self._check_inputs(args)
        args, structure = flatten_inputs(args, self._unpacked)
        facts = self._grad_facts(flags := self._guard.training_flags())  # (once per call)
        grad = self._needs_grad(args, facts)
        if grad and self._untrainable:
            raise FusionError(f"{self._untrainable}: calls that record gradients cannot be "
                              "compiled; train through torch.compile(model, "
                              "backend='fusion_compiler')")
        requires = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        amp = autocast_dtype(args)
        frozen = tuple(p.requires_grad for p in self._model_params) if grad else ()
        # inference mode (the caller's or the forward's decorator): graphs captured in it return
        # inference tensors as eager does; a no_grad call gets normal ones (it may write them)
        inference = not grad and (torch.is_inference_mode_enabled() or facts.inference)
        grad_mode = torch.is_grad_enabled() or not (facts.reads or facts.enables)
        key = (input_specs(args), self.model.training, grad, requires if grad else (), amp,
               frozen, inference, structure, flags, grad_mode,
               torch.get_default_dtype())  # (the dtype of torch.tensor([0.5]) in forward)
        spec = self.specializations.get(key)
        if spec is not None:
            self.specializations.move_to_end(key)
            return spec, args
        refused = unsupported_hook(self.model)
        if refused:
            raise FusionError(refused)
        log.info("compiling %s for inputs %s", type(self.model).__name__,
                 ", ".join(str(s) for s in key[0] if isinstance(s, TensorSpec)))
        target = Target(cuda=any(isinstance(a, torch.Tensor) and a.is_cuda for a in args),
                        training=grad, autocast=amp, inference=inference, grad_enabled=grad_mode)
        spec = self._compiler.build(args, key, target, requires, answer_early, structure)
        self._guard.take()  # checked above; the new trace may have read more attributes
        self.specializations[key] = spec
        while len(self.specializations) > self.options.max_specializations:
            old_key, old = self.specializations.popitem(last=False)
            old.close()
            log.info("evicted the specialization for inputs %s (max_specializations=%d)",
                     ", ".join(str(s) for s in old_key[0] if isinstance(s, TensorSpec)),
                     self.options.max_specializations)
        return spec, args

    def wait_for_background_compiles(self, timeout: float | None = None) -> bool:
        """Block until every specialization's background compile (option ``tiered``) has
        ended, at most ``timeout`` seconds in all, and switch them to their last tier now (as
        benchmarks do before timing). Returns ``False`` if the timeout passed first. Those the
        model's state no longer matches (:meth:`_check_state`) are dropped, not finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_state()
        with on_device_of(self._dtype_ref):  # a tier switch captures (see forward)
            for spec in list(self.specializations.values()):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if isinstance(spec.run, TieredRunner) and not spec.run.wait(left):
                    return False
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling() or _fx_tracing() or torch.jit.is_tracing() or \
                torch.compiler.is_exporting():  # traced (Dynamo, fx, jit, export): the model
            return self.model(*args, **kwargs)
        try:  # on the model's device, as its ops run eagerly (runtime.tensors.on_device_of)
            with on_device_of(self._dtype_ref, args):
                if has_hooks(self.model):  # the model's own hooks, as calling it runs them
                    return call_with_hooks(self.model, self._call, args, kwargs)
                return self._call(*args, **kwargs)
        except InputError as exc:  # raised from here: the caller's frame and this one only
            raise exc.with_traceback(None)  # noqa: B904  (its cause is set where it is made)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != self._arity:
            args = self._bind(args, kwargs)
        if self._recompiles.uncompiled:  # a value forward reads changed at every call
            return uncompiled_forward(self.model)(*args)
        if in_cached_block(self.model):
            warn_once(f"compiling {type(self.model).__name__}", "calls inside torch.nn.utils."
                      "parametrize.cached() compute the parametrized tensors once per block, "
                      "which a compiled graph cannot: such calls run the model uncompiled")
            return uncompiled_forward(self.model)(*args)
        if self._writes and shared_storage(flatten_inputs(args, self._unpacked)[0],
                                           self._guard.storages):
            warn_once(f"compiling {type(self.model).__name__}", "an input shares memory with "
                      "another or the model's state and the graph writes in place: such calls "
                      "run the model uncompiled")
            return uncompiled_forward(self.model)(*args)  # (functionalize: inputs never alias)
        if self._untrainable and self._needs_grad(args):
            warn_once(f"compiling {type(self.model).__name__}", f"{self._untrainable}: calls "
                      "that record gradients run the model uncompiled (or train through "
                      "torch.compile(model, backend='fusion_compiler'))")
            return uncompiled_forward(self.model)(*args)
        try:
            spec, args = self._specialize(args, answer_early=True)
        except InputError as exc:
            raise self._explained(exc, args)  # noqa: B904  (its own cause, set there)
        if spec is not self.last:  # (nn.Module.__setattr__ costs microseconds per call)
            object.__setattr__(self, "last", spec)
        meta = spec.graph_module.meta  # (its trace's: forward's Python may choose the modes)
        try:
            if meta.get("grad", True):
                out = spec.run(*args)
            else:
                with torch.inference_mode() if meta.get("inference") else torch.no_grad():
                    out = spec.run(*args)
        finally:  # the mode a bare torch.set_grad_enabled in forward leaves, as eager leaves it
            if meta.get("grad_mode_left") is not None:
                torch._C._set_grad_enabled(meta["grad_mode_left"])
        types = meta.get("output_types")  # (an OrderedDict fx made a dict)
        return out if types is None else rebuilt(out, types)

    def report(self) -> str:
        """What the last specialization is, as text at most 100 columns wide: the summary
        ``fusion-compiler dump`` prints (convolutions and their FLOPs in regions, regions per
        backend, why regions fell back, why a default was not taken), how its calls run (tier,
        glue, CUDA graph), the region table (pattern, backend, plan or reason) and
        the ops left to PyTorch, grouped by reason; for a training specialization also how each
        region's backward runs (dgrad and wgrad, each on cuDNN or PyTorch, with times)."""
        if self.last is None:
            return "not compiled yet: call the module once (or pass example_inputs)"
        from .tables import coverage, format_gradients, format_report  # noqa: PLC0415

        text = format_report(coverage(self.last), type(self.model).__name__, runs=True)
        if self.last.training:
            text += "\n" + format_gradients(self.last.regions)
        return text


def compile(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None, *,
            options: CompileOptions | None = None, **kwargs: Any) -> CompiledModule:
    """Compile ``model`` into fused regions and return a module that computes the same function.

    Args:
        model: an ``nn.Module`` whose ``forward`` ``torch.fx.symbolic_trace`` can trace.
        example_inputs: compile for these inputs now (else on the first call).
        options: a :class:`~fusion_compiler.config.CompileOptions`; ``kwargs`` (its field names:
            ``backends``, ``cuda_graph``, ``cache_dir``, ``autotune``, ``fuse_prologue``,
            ``fuse_reduction``, ``progress``, ``glue_backend``,
            ``max_specializations``, ``tiered``, ``freezing``, ``passes`` (your own graph
            passes), ...) replace its fields.
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


_fx_tracing = getattr(_symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` or :func:`compile` wrapped (compiled again); else ``model``."""
    inner = model.model if isinstance(model, CompiledModule) else getattr(model, "_orig_mod", None)
    if type(model).__name__ in ("OptimizedModule", "CompiledModule") and isinstance(
            inner, torch.nn.Module):
        log.info("compiling the module %s wrapped (%s)", type(model).__name__, type(inner))
        return inner
    return model

