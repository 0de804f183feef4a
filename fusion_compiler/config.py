"""The settings object: every option of :func:`fusion_compiler.compile` with its default, in one
place, validated once (:class:`CompileOptions`), and what a specialization is compiled for
(:class:`Target`). Every door derives its settings from :class:`CompileOptions`: ``compile()``
from its keyword arguments, the ``torch.compile`` backend from ``options={...}``
(:meth:`CompileOptions.for_dynamo`), ``fusion-compiler dump`` (:meth:`CompileOptions.for_dump`)
and the CLI's flags (whose defaults are read from here). What each option does, with the
measurements behind the defaults: ``docs/options.md`` and ``docs/decisions.md``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = ["CompileOptions", "Target", "DEFAULT_BACKENDS", "CUDA_GRAPH_MODES", "DYNAMO_MODES",
           "CUSTOM_PASS_PIPELINES"]

DEFAULT_BACKENDS = ("triton_stem", "dense", "triton_depthwise", "cudnn")
"""The default of :attr:`CompileOptions.backends`."""
CUDA_GRAPH_MODES = ("auto", True, False)
"""Values of :attr:`CompileOptions.cuda_graph` (``True`` is ``"auto"``)."""
DYNAMO_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""Values of ``torch.compile``'s ``mode`` the backend takes (:meth:`CompileOptions.for_dynamo`)."""
CUSTOM_PASS_PIPELINES = ("pre_fusion", "post_lowering")
"""The pipelines a user's own graph passes may join (:attr:`CompileOptions.passes`)."""


@dataclass(frozen=True)
class Target:
    """What one specialization is compiled for.

    Attributes:
        cuda: its tensor inputs are on a CUDA device.
        training: a call needs gradients (grad mode on and a parameter or input requiring grad).
        autocast: the ``torch.autocast`` dtype active for the inputs' device, or ``None``.
        inference: calls run inside ``torch.inference_mode()`` (the caller's, or the forward's
            own decorator): CUDA graphs are captured in it, so their outputs are inference
            tensors as eager's are there.
        grad_enabled: the caller's grad mode, what ``torch.is_grad_enabled()`` in ``forward``
            is traced as (:func:`~fusion_compiler.capture.capture`); ``False`` in a training
            specialization too where a ``torch.enable_grad`` block in forward records gradients
            in a call made without them (its step is then not captured in a CUDA graph).
    """

    cuda: bool
    training: bool = False
    autocast: torch.dtype | None = None
    inference: bool = False
    grad_enabled: bool = True


@dataclass(frozen=True)
class CompileOptions:
    """How :func:`fusion_compiler.compile` compiles a model (all keyword arguments of it).

    Attributes:
        backends: the backends lowering may give a region, in the order it asks them (names
            registered in :mod:`fusion_compiler.backends`; a comma-separated string is taken
            too). Where several take a region, their kernels are timed on the region's shapes
            on CUDA and the fastest kept; off CUDA the first is. A region none of them takes
            runs on the ``reference`` backend (PyTorch ops), which is always the fallback and is
            not named here; ``()``: every region on PyTorch ops. Built in: ``"triton_stem"``
            (the SpaceToDepth stem kernel, CUDA inference), ``"triton_conv"`` (an implicit-GEMM
            convolution in Triton; not in the default: cuDNN was faster on every region
            measured, docs/options.md), ``"dense"`` (a convolution of an image no larger than
            its filter as one dense GEMM, CUDA inference; faster than cuDNN on SE-ResNet9's 2x2
            layer), ``"triton_depthwise"`` (a depthwise convolution in Triton, CUDA inference,
            timed against cuDNN per region), ``"cudnn"`` (cuDNN execution plans). With other
            than the default, each region left to the reference is a warning.
        cuda_graph: ``"auto"`` (``True``): on CUDA each specialization replays its whole forward
            (and a training one its backward) as a CUDA graph, outputs never overwritten by a
            later call; ``False``: no CUDA graph.
        cache_dir: directory of the on-disk plan and shape cache (``None``:
            ``$FUSION_COMPILER_CACHE_DIR`` or the user cache directory; ``False``: memory only).
        autotune: cuDNN execution plans built and timed per region (``<= 1``: heuristics' first).
        fuse_prologue: fuse pointwise ops on a convolution's input into its region.
        fuse_reduction: fuse the H, W sum after a convolution into its region.
        progress: a progress bar while plans build (``None``: only on a terminal).
        glue_backend: the ``torch.compile`` backend of the ops between regions (``"auto"``:
            Inductor on CUDA when Triton imports, eager ops for inference without a CUDA graph;
            ``None``: eager ops).
        max_specializations: input signatures kept; the least recently used is evicted.
        tiered: answer a new specialization's first calls at once while plans and the glue
            compile in the background (CUDA inference in a CUDA graph).
        horizontal_fusion: in inference on CUDA, convolutions that read the same image with the
            same geometry (a block's first convolution and its downsample) run as one
            convolution with their weights concatenated
            (:mod:`fusion_compiler.passes.pre_fusion.horizontal`; on: faster on SE-ResNet9,
            docs/options.md).
        freezing: inference CUDA graphs treat the parameters and buffers as constants: what they
            derive from them (folded batch norms, re-laid-out or packed weights) is made when the
            graph is captured and never checked again, so an in-place update (an optimizer step,
            ``load_state_dict``) is not seen; a replaced tensor still recompiles (off: each replay
            checks the contents and rewrites what changed, :mod:`fusion_compiler.runtime.derive`;
            the name is Inductor's for the same opt-in).
        passes: the user's own graph passes, by pipeline: ``{"pre_fusion": [fn, ...],
            "post_lowering": [fn, ...]}`` (a single callable for a list of one). Each
            ``fn(gm: torch.fx.GraphModule)`` rewrites the graph (in place, returning ``None``, or
            returning the graph to go on with); a pipeline's passes run in order after its own
            passes (``post_lowering``: before ``hoist``). Kept as a tuple of
            ``(pipeline, (fn, ...))`` pairs. What each pipeline's graph looks like:
            docs/options.md, "passes".

    Raises (on construction):
        ValueError: a value outside an option's choices or range (the message names the option,
            the value and what it takes).
        TypeError: a value of the wrong type.
    """

    backends: Any = DEFAULT_BACKENDS
    cuda_graph: bool | str = "auto"
    cache_dir: str | os.PathLike | bool | None = None
    autotune: int = 8
    fuse_prologue: bool = False
    fuse_reduction: bool = False
    progress: bool | None = None
    glue_backend: str | None = "auto"
    max_specializations: int = 16
    tiered: bool = True
    _derived_backward: bool = False
    _cuda_pipeline: bool | None = None
    horizontal_fusion: bool = True
    freezing: bool = False
    passes: Any = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", _backend_names(self.backends))
        if self.cuda_graph not in CUDA_GRAPH_MODES or isinstance(self.cuda_graph, int) and \
                not isinstance(self.cuda_graph, bool):
            raise ValueError(f"cuda_graph must be one of {CUDA_GRAPH_MODES}, got "
                             f"{self.cuda_graph!r}")
        if self.cuda_graph is True:
            object.__setattr__(self, "cuda_graph", "auto")
        for name in ("fuse_prologue", "fuse_reduction", "tiered",
                     "_derived_backward", "horizontal_fusion", "freezing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("progress", "_cuda_pipeline"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"{name} must be None, True or False, got "
                                f"{getattr(self, name)!r}")
        for name, low in (("autotune", 0), ("max_specializations", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be at least {low}, got {value}")
        object.__setattr__(self, "passes", _custom_passes(self.passes))
        if self.glue_backend is not None and not isinstance(self.glue_backend, str):
            raise TypeError(f"glue_backend must be a torch.compile backend name or None, got "
                            f"{self.glue_backend!r}")
        if self.cache_dir is not None and self.cache_dir is not False and not isinstance(
                self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a path, None or False, got {self.cache_dir!r}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_kwargs(cls, options: "CompileOptions | None" = None,
                    **kwargs: Any) -> "CompileOptions":
        """``options`` (default: the defaults) with ``kwargs`` replacing its fields.

        Raises:
            TypeError: an unknown option name (the message suggests the nearest one).
            ValueError: see the class.
        """
        base = options if options is not None else cls()
        if not isinstance(base, CompileOptions):
            raise TypeError(f"options must be a CompileOptions, got {type(base).__name__}")
        names = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        for key in kwargs:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise TypeError(f"unknown compile option {key!r}{hint} (options: "
                                f"{', '.join(names)})")
        return dataclasses.replace(base, **kwargs) if kwargs else base

    def replace(self, **changes: Any) -> "CompileOptions":
        """A copy with ``changes`` (validated as on construction)."""
        return self.from_kwargs(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The options as keyword arguments of :func:`fusion_compiler.compile` (the internal
        settings, :meth:`internal`, are not among them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.name.startswith("_")}

    def internal(self, *, cuda_pipeline: bool | None = None,
                 derived_backward: bool | None = None) -> "CompileOptions":
        """A copy with the package's internal settings changed (``None``: kept), which no door
        takes from a user: for this package's tools and tests.

        Args:
            cuda_pipeline: ``True``: run the passes a CUDA input gets whatever the inputs'
                device (what ``fusion-compiler dump`` shows on any machine); ``False``: the
                inputs' device decides (the default).
            derived_backward: in training, regions on PyTorch ops also run through the
                ``run_region`` op with the backward derived from their graph (the path cuDNN
                regions take), so it can be checked without a GPU.
        """
        changes: dict[str, Any] = {}
        if cuda_pipeline is not None:
            changes["_cuda_pipeline"] = cuda_pipeline
        if derived_backward is not None:
            changes["_derived_backward"] = derived_backward
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def cuda_pipeline(self) -> bool | None:
        """The internal setting of :meth:`internal`."""
        return self._cuda_pipeline

    @property
    def derived_backward(self) -> bool:
        """The internal setting of :meth:`internal`."""
        return self._derived_backward

    def for_dump(self) -> "CompileOptions":
        """What ``fusion-compiler dump`` compiles with: no CUDA graph and no glue backend (both
        change how the graph is called, not its regions) and the CUDA pass pipeline on any
        machine, so a machine without a GPU shows the graphs a GPU gets."""
        return self.replace(cuda_graph=False, glue_backend=None).internal(cuda_pipeline=True)

    @classmethod
    def for_dynamo(cls, options: Mapping[str, Any] | None,
                   mode: str | None = None) -> "CompileOptions":
        """The options of the graphs ``torch.compile(..., backend="fusion_compiler")`` hands over:
        ``options={...}`` (this class's fields) on top of :func:`fusion_compiler.compile`'s
        defaults, CUDA graph included. ``mode`` is ``torch.compile``'s: ``None``,
        ``"default"``, ``"reduce-overhead"`` and ``"max-autotune"`` keep the defaults (each
        already replays a CUDA graph and autotunes the plans); ``"max-autotune-no-cudagraphs"``
        turns the CUDA graph off.

        Raises:
            TypeError: an unknown option.
            ValueError: an invalid option value, or an unknown ``mode``.
        """
        if mode not in DYNAMO_MODES:
            raise ValueError(f"mode must be one of {', '.join(map(repr, DYNAMO_MODES))}, got "
                             f"{mode!r}")
        base = cls(cuda_graph=False) if mode == "max-autotune-no-cudagraphs" else cls()
        return cls.from_kwargs(base, **dict(options or {}))

    def custom_passes(self, pipeline: str) -> tuple[Callable[..., Any], ...]:
        """The user's passes for ``pipeline`` (:attr:`passes`), in order."""
        return dict(self.passes).get(pipeline, ())

    # ------------------------------------------------------------------ derived decisions
    def graphed_inference(self, target: Target) -> bool:
        """Whether a specialization is CUDA inference in a CUDA graph: what tiering and the
        derivation prologue apply to."""
        return target.cuda and not target.training and bool(self.cuda_graph)

    def tiers_before_lowering(self, target: Target) -> bool:
        """Whether a call may answer from tier 0 while the plans build (``tiered``, CUDA
        inference in a CUDA graph, no autocast)."""
        return self.tiered and target.autocast is None and self.graphed_inference(target)


def _custom_passes(value: Any) -> tuple[tuple[str, tuple[Callable[..., Any], ...]], ...]:
    """:attr:`CompileOptions.passes` as ``((pipeline, (fn, ...)), ...)``.

    Raises:
        ValueError: a pipeline not in :data:`CUSTOM_PASS_PIPELINES`.
        TypeError: not a mapping (or such pairs), or a pass that is not callable.
    """
    if value is None:
        return ()
    try:
        items = list(value.items() if isinstance(value, Mapping) else value)
        pairs = [(pipeline, fns) for pipeline, fns in items]
    except (TypeError, ValueError):
        raise TypeError("passes must map a pipeline name to a list of graph passes, e.g. "
                        f"{{'pre_fusion': [my_pass]}}, got {value!r}") from None
    result = []
    for pipeline, fns in pairs:
        if pipeline not in CUSTOM_PASS_PIPELINES:
            raise ValueError(f"passes: unknown pipeline {pipeline!r} (user passes join one of "
                             f"{', '.join(CUSTOM_PASS_PIPELINES)})")
        fns = (fns,) if callable(fns) else tuple(fns)
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"passes[{pipeline!r}]: {fn!r} is not callable (a pass is "
                                "fn(gm: torch.fx.GraphModule) -> GraphModule or None)")
        if fns:
            result.append((pipeline, fns))
    return tuple(result)


def _backend_names(value: Any) -> tuple[str, ...]:
    """:attr:`CompileOptions.backends` as a tuple of names (whether each is registered, the
    registry checks: :func:`fusion_compiler.backends.registry.check_backends`).

    Raises:
        TypeError: not a string or a sequence of strings.
        ValueError: a name given twice, or ``"reference"`` (always the fallback).
    """
    if isinstance(value, str):
        value = [name.strip() for name in value.split(",") if name.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"backends must be a sequence of backend names such as "
                        f"{DEFAULT_BACKENDS!r}, got {value!r}")
    names = tuple(value)
    if "reference" in names:
        raise ValueError("backends: 'reference' (PyTorch ops) is always the fallback and is not "
                         "listed; backends=() runs every region on it")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"backends: {', '.join(map(repr, twice))} given more than once")
    return names
