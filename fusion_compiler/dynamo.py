"""``torch.compile(model, backend="fusion_compiler")``: the Dynamo backend.

Installed (``pip install``), the package declares the backend as a ``torch_dynamo_backends``
entry point (``pyproject.toml``), which Dynamo loads and registers by itself, with or without
``import fusion_compiler``; from a source checkout on ``PYTHONPATH`` (no entry point),
``import fusion_compiler`` registers the name (:func:`register`).

Dynamo hands over one ``fx.GraphModule`` per graph between graph breaks, with example inputs that
are ``FakeTensor`` s (and, with ``torch._dynamo.config.inline_inbuilt_nn_modules``, the default,
the module's parameters among the inputs). Fake inputs cannot be compiled against (cuDNN plans are
built and timed on real memory), so each graph is wrapped in a
:class:`~fusion_compiler.CompiledModule` that specializes on the first real call, exactly as
``fusion_compiler.compile`` does: the same passes, regions, fallbacks with reasons, and
re-specialization when shapes, strides or dtypes change. While gradients are needed (training) the
specialization is a training one: cuDNN regions run through the ``run_region`` custom op with
their fused backward (:mod:`fusion_compiler.autograd.backward`); under
``torch.no_grad``/``inference_mode`` they run inference plans.

Which front door to use: ``fusion_compiler.compile`` for a whole ``nn.Module`` that
``torch.fx.symbolic_trace`` can trace (one graph, parameter-only work hoisted, optional CUDA graph
capture); ``torch.compile(..., backend="fusion_compiler")`` for models with Python control flow or
untraceable code, where Dynamo splits the model into graphs and runs the rest in Python.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
from typing import Any, Callable, Sequence

import torch.fx as fx

from .compiler import CompiledModule
from .config import CompileOptions

__all__ = ["fusion_compiler_backend", "register", "BACKEND_NAME"]

BACKEND_NAME = "fusion_compiler"
_REGISTRY = "torch._dynamo.backends.registry"
_GROUP = "torch_dynamo_backends"


def fusion_compiler_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                            options: dict[str, Any] | None = None,
                            mode: str | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph; returns the callable Dynamo runs in its place.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs (``FakeTensor`` s; only their number is used here).
        options: :func:`fusion_compiler.compile` options, given as
            ``torch.compile(..., options={...})``
            (:meth:`~fusion_compiler.config.CompileOptions.for_dynamo`).
        mode: not used (there is one mode); accepted because ``torch.compile`` passes it.

    Raises:
        TypeError: an unknown option, or ``cuda_graph`` (Dynamo graphs run between Python code,
            so there is no whole forward to capture; use ``fusion_compiler.compile`` for that), or
            ``glue_backend`` (this graph already runs inside a ``torch.compile`` call; use
            ``fusion_compiler.compile(model, glue_backend=...)``).
        ValueError: an invalid option value.
        FusionError: the graph cannot be retraced or breaks the cuDNN graph rules (on first call).
    """
    compiled = CompiledModule(gm, CompileOptions.for_dynamo(options))

    def run(*args: Any) -> Any:
        return compiled(*args)

    run.compiled_module = compiled  # for inspection: run.compiled_module.report()
    return run


def _installed() -> bool:
    """Whether an installed distribution declares this backend as a ``torch_dynamo_backends``
    entry point: then Dynamo loads it by that name itself."""
    return BACKEND_NAME in importlib.metadata.entry_points(group=_GROUP).names


def _register_now(registry: Any) -> None:
    """Add the backend to Dynamo's ``registry`` module, unless an installed entry point declares
    it or a backend of that name is there. Dynamo registers an entry point's backend itself when
    it first looks the name up, after loading it (which imports this package): registered here
    too, its own registration then failed ("duplicate name")."""
    if _installed():
        return
    try:
        registry.register_backend(fusion_compiler_backend, name=BACKEND_NAME)
    except AssertionError:  # "duplicate name": registered already (e.g. a second import path)
        pass


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when Python looks for Dynamo's backend registry module, it lets the
    normal path finder load it and then registers the backend in it (see :func:`register`)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            _register_now(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register() -> None:
    """Make ``torch.compile(model, backend="fusion_compiler")`` find this backend by name.

    Dynamo looks names up in ``torch._dynamo.backends.registry``. Importing ``torch._dynamo``
    is slow (measurements: docs/decisions.md, "Keeping ``import fusion_compiler`` light"), so
    when it is not imported yet the backend is registered the moment it is (a ``sys.meta_path``
    finder that wraps the registry module's loader), and ``import fusion_compiler`` stays fast.
    Called by ``import fusion_compiler``; calling it again does nothing.
    """
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _register_now(registry)
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
