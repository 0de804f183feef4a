"""``torch.compile(model, backend="fusion_compiler")``: the Dynamo backend.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so the name
works once the package is installed; importing this module is not needed.

Dynamo hands over one ``fx.GraphModule`` per graph between graph breaks, with example inputs that
are ``FakeTensor`` s (and, with ``torch._dynamo.config.inline_inbuilt_nn_modules``, the default,
the module's parameters among the inputs). Fake inputs cannot be compiled against (cuDNN plans are
built and timed on real memory), so each graph is wrapped in a :class:`~fusion_compiler.CompiledModule`
that specializes on the first real call, exactly as ``fusion_compiler.compile`` does: the same
passes, regions, fallbacks with reasons, and re-specialization when shapes, strides or dtypes
change. While gradients are needed (training) the specialization is a training one: cuDNN regions
run through the ``run_region`` custom op with their fused backward (:mod:`fusion_compiler.backward`);
under ``torch.no_grad``/``inference_mode`` they run inference plans.

Which front door to use: ``fusion_compiler.compile`` for a whole ``nn.Module`` that
``torch.fx.symbolic_trace`` can trace (one graph, parameter-only work hoisted, optional CUDA graph
capture); ``torch.compile(..., backend="fusion_compiler")`` for models with Python control flow or
untraceable code, where Dynamo splits the model into graphs and runs the rest in Python.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

from .compiler import CompiledModule

__all__ = ["fusion_compiler_backend"]


def fusion_compiler_backend(gm: fx.GraphModule, example_inputs: Sequence[Any],
                            options: dict[str, Any] | None = None,
                            mode: str | None = None) -> Callable[..., Any]:
    """Compile one Dynamo graph; returns the callable Dynamo runs in its place.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs (``FakeTensor`` s; only their number is used here).
        options: :func:`fusion_compiler.compile` options (``backend``, ``autotune``,
            ``fuse_prologue``, ``fuse_reduction``, ``cache_dir``, ``report``,
            ``derived_backward``), given as
            ``torch.compile(..., options={...})``.
        mode: not used (there is one mode); accepted because ``torch.compile`` passes it.

    Raises:
        TypeError: an unknown option, or ``cuda_graph`` (Dynamo graphs run between Python code,
            so there is no whole forward to capture; use ``fusion_compiler.compile`` for that), or
            ``glue_backend`` (this graph already runs inside a ``torch.compile`` call; use
            ``fusion_compiler.compile(model, glue_backend=...)``).
        FusionError: the graph cannot be retraced or breaks the cuDNN graph rules (on first call).
    """
    options = dict(options or {})
    if "cuda_graph" in options:
        raise TypeError("cuda_graph is an option of fusion_compiler.compile, not of the "
                        "torch.compile backend (Dynamo graphs run between Python code)")
    if "glue_backend" in options:
        raise TypeError("glue_backend is an option of fusion_compiler.compile, not of the "
                        "torch.compile backend (this graph is already being compiled by "
                        "torch.compile)")
    # no whole-forward CUDA graph (Dynamo graphs run between Python code) and no glue backend
    # (this graph already runs inside torch.compile)
    compiled = CompiledModule(gm, **options, cuda_graph=False, glue_backend=None)

    def run(*args: Any) -> Any:
        return compiled(*args)

    run.compiled_module = compiled  # for inspection: run.compiled_module.report()
    return run
