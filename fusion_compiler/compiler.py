"""``fusion_compiler.compile``: capture -> passes -> lowering -> runtime, specialized per input signature."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from .backends.cudnn import DEFAULT_AUTOTUNE
from .capture import TensorSpec, capture, input_specs
from .lowering import lower, regions_of
from .passes import Pass, PassManager, default_passes
from .passes.autocast import make_autocast_explicit
from .region import Region
from .runtime.hoist import hoist_parameter_subgraphs
from .runtime.layout import channels_last_inputs, nchw_padded_avg_pools

__all__ = ["compile", "CompiledModule"]

log = logging.getLogger("fusion_compiler")


@dataclass
class Specialization:
    """One compiled graph for one input signature."""

    signature: tuple
    graph_module: fx.GraphModule
    run: Callable[..., Any]
    stages: dict[str, str]

    @property
    def regions(self) -> list[Region]:
        return regions_of(self.graph_module)


def _memory_format(t: Any) -> torch.memory_format | None:
    """The memory format eager returned for an output (``None``: leave it as it comes)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return None
    if t.is_contiguous():
        return torch.contiguous_format
    if t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


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
    device from every earlier one compiles a new specialization (``specializations`` lists them).
    A call under ``torch.autocast`` gets its own specialization in which the autocast casts are
    explicit graph ops (:mod:`.passes.autocast`), so regions form in the autocast dtype.
    Calls that need gradients (grad mode on and a parameter or input requiring grad) get their own
    training specialization, whose cuDNN regions run a fused backward (:mod:`.backward`).
    ``derived_backward`` makes PyTorch-backend regions use that backward too (for tests).
    ``glue_backend`` hands each specialization's graph to ``torch.compile`` with that backend
    (see :func:`compile`).

    Raises (on call):
        TypeError: wrong number of inputs, or a floating input whose dtype differs from the
            model's parameters (expected and actual dtypes are in the message).
        ValueError: an input on another device than the model's parameters.
        FusionError: the graph cannot be captured or breaks the cuDNN graph rules.
    """

    def __init__(self, model: torch.nn.Module, *, backend: str = "auto", cuda_graph: bool = False,
                 cache_dir=None, autotune: int = DEFAULT_AUTOTUNE, fuse_prologue: bool = False,
                 fuse_reduction: bool = False, passes: Sequence[Pass] | None = None,
                 report: bool = False, progress: bool | None = None,
                 derived_backward: bool = False, glue_backend: str | None = None):
        super().__init__()
        self.derived_backward = derived_backward
        self.glue_backend = glue_backend
        self.model = model
        self.backend = backend
        self.cuda_graph = cuda_graph
        self.cache_dir = cache_dir
        self.autotune = autotune
        self.passes = list(passes) if passes is not None else default_passes(
            fuse_prologue=fuse_prologue, fuse_reduction=fuse_reduction)
        self.show_report = report
        self.progress = progress
        self._arity = len(capture(model).graph.find_nodes(op="placeholder"))  # fail early
        self.specializations: dict[tuple, Specialization] = {}
        self.last: Specialization | None = None

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

    # ------------------------------------------------------------------ compile
    def specialize(self, *args: Any) -> Specialization:
        """Compile (or fetch) the specialization for inputs like ``args``."""
        self._check_inputs(args)
        grad = self._needs_grad(args)
        requires = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        amp = _autocast_dtype(args)
        key = (input_specs(args), self.model.training, grad, requires if grad else (), amp)
        spec = self.specializations.get(key)
        if spec is not None:
            return spec
        log.info("compiling %s for inputs %s", type(self.model).__name__,
                 ", ".join(str(s) for s in key[0] if isinstance(s, TensorSpec)))
        stages: dict[str, str] = {}
        formats: list[torch.memory_format | None] = []

        def on_stage(name: str, g: fx.GraphModule) -> None:
            stages[name] = g.code
            if name == "captured":  # the memory formats eager returns, before any rewrite
                out = g.graph.find_nodes(op="output")[0]
                formats.extend(_memory_format(n.meta.get("val") if isinstance(n, fx.Node) else n)
                               for n in tree_flatten(out.args[0])[0])

        passes = self.passes
        if amp is not None:  # casts before the fuse pass, so regions form in the autocast dtype
            at = next((i for i, p in enumerate(passes) if p.name == "fuse"), len(passes))
            passes = [*passes[:at], Pass("autocast", functools.partial(make_autocast_explicit,
                                                                        dtype=amp)), *passes[at:]]
        gm = PassManager(passes, args, on_stage=on_stage).run(capture(self.model))
        frozen = frozenset(ph.name for ph, needs in zip(gm.graph.find_nodes(op="placeholder"),
                                                          requires) if not needs)
        lower(gm, self.backend, progress=self.progress, training=grad,
              derived_backward=self.derived_backward, no_grad_inputs=frozen,
              cache_dir=self.cache_dir, autotune=self.autotune)
        channels_last_inputs(gm)
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if grad and on_cuda and (pools := nchw_padded_avg_pools(gm)):
            log.info("%d padded avg_pool2d input(s) made NCHW: PyTorch's channels_last CUDA "
                     "backward is wrong with padding (pytorch/pytorch#188344)", pools)
        hoisted = None if grad else hoist_parameter_subgraphs(gm)
        call = gm if self.glue_backend is None else torch.compile(
            gm, backend=self.glue_backend, fullgraph=True, dynamic=False)

        def run(*inputs: Any) -> Any:
            if hoisted is not None:
                hoisted.refresh()
            out = call(*inputs)
            if not any(f is not None for f in formats):
                return out
            flat = iter(formats)
            return tree_map(lambda t: t.contiguous(memory_format=f)
                            if (f := next(flat)) is not None and not t.is_contiguous(memory_format=f)
                            else t, out)

        runner = run
        if self.cuda_graph and not grad and on_cuda:
            from .runtime.cuda_graph import CudaGraphRunner  # noqa: PLC0415

            params = [t for t in (*self.model.parameters(), *self.model.buffers())
                      if not t.is_inference()]
            runner = CudaGraphRunner(run, args, guard=lambda: tuple(p._version for p in params))
        spec = Specialization(key, gm, runner, stages)
        self.specializations[key] = spec
        if self.show_report:
            from .report import format_gradients, format_regions  # noqa: PLC0415

            print(format_regions(spec.regions))
            if grad:
                print(format_gradients(spec.regions))
        return spec

    def forward(self, *args: Any) -> Any:
        self.last = self.specialize(*args)
        return self.last.run(*args)

    def report(self) -> str:
        """The region table of the last specialization (as the CLI dump prints it)."""
        if self.last is None:
            return "not compiled yet: call the module once (or pass example_inputs)"
        from .report import format_regions  # noqa: PLC0415

        return format_regions(self.last.regions)


def compile(model: torch.nn.Module, example_inputs: Sequence[Any] | None = None, *,
            backend: str = "auto", cuda_graph: bool = False, cache_dir=None,
            autotune: int = DEFAULT_AUTOTUNE, fuse_prologue: bool = False,
            fuse_reduction: bool = False, report: bool = False,
            progress: bool | None = None, glue_backend: str | None = None) -> CompiledModule:
    """Compile ``model`` into fused regions and return a module that computes the same function.

    Args:
        model: an ``nn.Module`` whose ``forward`` ``torch.fx.symbolic_trace`` can trace.
        example_inputs: compile for these inputs now (else on the first call).
        backend: ``"auto"`` (cuDNN where it takes a region, PyTorch ops elsewhere), ``"cudnn"``
            (same, but each fallback is a warning) or ``"reference"`` (PyTorch ops only).
        cuda_graph: on CUDA, capture the whole forward in one CUDA graph per input signature.
            Outputs are then static buffers overwritten by the next call: clone what you keep.
        cache_dir: where serialized cuDNN plans are kept (default: ``$FUSION_COMPILER_CACHE_DIR``
            or the user cache directory; ``False`` disables the cache).
        autotune: per region, how many of cuDNN's ranked execution plans to build and time on
            random data of the region's shapes; the fastest is kept (and cached), and the region
            stays on PyTorch ops when those time at least 10% faster. ``1`` takes heuristics'
            first plan that builds and times nothing (fastest compile).
        fuse_prologue: fuse pointwise ops on a convolution's input (the Fixup ``x + bias``) into
            its region. Off by default: on an H100 with cuDNN 9.19 the fused kernel was 2-4x
            slower than the convolution plus a separate add (see ``passes.default_passes``).
        fuse_reduction: fuse the H, W sum after a convolution (the SE squeeze) into its region
            as an exit reduction. Off by default for the same reason.
        report: print the region table after each compilation (and, for a training
            specialization, how each region's backward runs).
        progress: progress bar while plans build (``None``: only on a terminal).
        glue_backend: a ``torch.compile`` backend (``"inductor"``, ``"aot_eager"``, ...) for
            what is not a region: each specialization's graph, with every region an opaque
            ``fusion_compiler::run_region`` call, is compiled by it on its first call
            (``fullgraph=True, dynamic=False``). With ``"inductor"`` the PyTorch ops between
            regions (the SE gate, residual adds) fuse into Triton kernels, and in training so do
            the pointwise rules and bias sums of every region's backward, which AOTAutograd traces
            from the region's backward formula (dgrad and wgrad stay opaque cuDNN calls). Costs
            Inductor's compile time on the first call of each specialization. ``None`` (default)
            runs them as eager PyTorch ops.

    Training: a call that needs gradients compiles a training specialization whose cuDNN regions
    have a derived backward (dgrad and wgrad as cuDNN graphs, :mod:`fusion_compiler.backward`);
    under ``torch.autocast`` the autocast casts become graph ops (:mod:`.passes.autocast`).

    Raises:
        FusionError: the model cannot be traced or its graph breaks the cuDNN graph rules.
        ValueError: unknown ``backend``.
    """
    from .lowering import BACKEND_CHOICES  # noqa: PLC0415

    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    compiled = CompiledModule(model, backend=backend, cuda_graph=cuda_graph, cache_dir=cache_dir,
                              autotune=autotune, fuse_prologue=fuse_prologue,
                              fuse_reduction=fuse_reduction, report=report, progress=progress,
                              glue_backend=glue_backend)
    if example_inputs is not None:
        compiled.specialize(*example_inputs)
    return compiled
