"""The glue (the ops between regions): which ``torch.compile`` backend compiles it
(:func:`glue_backend`), and Inductor's configuration and compile of it. Every function here that
compiles or patches configuration runs on the calling thread (the rule of
:mod:`fusion_compiler.runtime.background`). Why each default is what it is: ``docs/decisions.md``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .config import CompileOptions, Target
from .passes.glue import auto_glue_backend, inductor_reason, inductor_work
from .runtime.background import on_calling_thread

__all__ = ["glue_backend", "glue_compiled", "inductor_reason", "inductor_compile",
           "inductor_without_autograd_cache", "without_custom_op_alias_check"]


def glue_backend(options: CompileOptions, gm: fx.GraphModule,
                 target: Target) -> tuple[str | None, str]:
    """The ``torch.compile`` backend for the lowered graph ``gm`` (``None``: eager ops), and why
    ``"auto"`` did not take Inductor where it would have (``""`` otherwise: a note for the
    specialization).

    ``"auto"``: Inductor on CUDA when Triton imports (else eager ops, the reason returned),
    except for an inference forward run without a CUDA graph: called from Python, each region
    is then one more dispatch of the ``run_region`` op from Inductor's code, while eager glue
    calls the plans directly, and eager glue was the faster (measurements: docs/decisions.md,
    "``glue_backend="auto"`` runs eager glue for inference without a CUDA graph"); and except for
    an inference graph with nothing for Inductor to compile
    (:func:`~fusion_compiler.passes.glue.inductor_work`: its glue is regions on kernels of their
    own, bare convolutions, this package's glue kernels, views and casts), whose CUDA graph holds
    the same kernels either way (docs/decisions.md, "The SE block's tail in the gate's kernel").
    Nor for a graph holding Dynamo's
    ``autograd_function_apply`` op (a custom ``torch.autograd.Function`` the door captured),
    which Dynamo cannot trace again (torch 2.11: "unsupported HigherOrderOperator").

    Eager ops, whatever the option, for a training specialization called without gradients
    (``target.grad_enabled`` false: a ``torch.enable_grad`` block in forward records them):
    the graph Inductor compiled for such a call recorded none (H200, torch 2.11).
    """
    if target.training and not target.grad_enabled:
        return None, ("the glue runs as PyTorch ops: the call is made without gradients and a "
                      "torch.enable_grad block records some, which Inductor's glue would not")
    if options.glue_backend != "auto":
        return options.glue_backend, ""
    if not target.cuda:
        return None, ""
    return auto_glue_backend(options, gm, target.training,
                             lambda: target.training or bool(inductor_work(gm)))


def inductor_compile(gm: fx.GraphModule, example: Sequence[Any]) -> Callable[..., Any]:
    """``gm`` compiled by Inductor for inputs like ``example`` (static shapes), without Dynamo.

    Called bare, ``torch._inductor.compile`` makes a fake-tensor mode without a shape
    environment, and Inductor's FX graph cache then bypasses every graph ("No shape env"). Here
    the compile runs in a tracing context whose fake mode has one, on inputs made fake with
    static shapes (as Dynamo hands them to a backend), so the graph is looked up in and written
    to the cache (``TORCHINDUCTOR_CACHE_DIR``).
    """
    on_calling_thread("Inductor's compile")
    from torch._guards import TracingContext, tracing  # noqa: PLC0415
    from torch._inductor import compile as compile_inductor  # noqa: PLC0415
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: PLC0415

    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
             for a in example]
    rebuild = _tensor_outputs_only(gm)
    with tracing(TracingContext(fake_mode)):
        compiled = compile_inductor(gm, fakes)
    if rebuild is None:
        return compiled
    return lambda *args: rebuild(compiled(*args))


def _tensor_outputs_only(gm: fx.GraphModule) -> Callable[[Sequence[Any]], Any] | None:
    """Rewrite ``gm`` (in place) to return its tensor outputs alone, as a tuple, where it also
    returns other values (a ``torch.Size``, an int: AOTAutograd fails on a returned size,
    "output spec mismatch"), and return what puts the others back, from the values the shape
    propagation recorded (static shapes: the same at every call of the specialization);
    ``None`` where every output is a tensor, or where a value was not recorded (``gm`` is left
    as it is)."""
    output = gm.graph.find_nodes(op="output")[0]
    leaves, spec = tree_flatten(output.args[0])

    def tensor(leaf: Any) -> bool:
        return isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor)

    if all(map(tensor, leaves)) or any(isinstance(leaf, fx.Node) and "val" not in leaf.meta
                                       for leaf in leaves):
        return None
    kept = {k: leaf.meta["val"] if isinstance(leaf, fx.Node) else leaf
            for k, leaf in enumerate(leaves) if not tensor(leaf)}
    output.args = (tuple(leaf for leaf in leaves if tensor(leaf)),)
    gm.recompile()

    def rebuild(tensors: Sequence[Any]) -> Any:
        values = iter(tensors)
        return tree_unflatten([kept[k] if k in kept else next(values)
                               for k in range(len(leaves))], spec)
    return rebuild


def without_custom_op_alias_check() -> contextlib.AbstractContextManager[Any]:
    """A context for the first call of a graph Inductor compiled, the call in which Inductor's
    Triton kernels autotune (each benchmarks its configs at its first launch).

    AOTAutograd runs a compiled graph's first call under a dispatch mode that checks the outputs
    of custom ops (here ``run_region``) for aliasing (``torch._functorch.config.
    check_custom_op_aliasing``); under it Inductor's benchmark loop runs through Python, the
    host launches slower than the kernels run and the configs' timings are noise. With the check
    off for that call the check runs at the next call instead (AOTAutograd keeps it pending). A
    no-op on a torch without that option. The option is process-wide (``config.patch`` saves
    and restores it), so it is patched only on the calling thread (the rule of
    :mod:`fusion_compiler.runtime.background`).
    """
    from torch._functorch import config  # noqa: PLC0415

    if not hasattr(config, "check_custom_op_aliasing"):
        return contextlib.nullcontext()
    return config.patch(check_custom_op_aliasing=False)


def inductor_without_autograd_cache(gm: fx.GraphModule, example: Sequence[Any]) -> Any:
    """A ``torch.compile`` backend: Inductor (``compile_fx``) with AOTAutograd's cache off for
    this compile, for glue graphs whose regions are differentiated.

    AOTAutograd's cache is keyed by the graph Dynamo hands over, in which each region is
    ``run_region(key, ...)`` with its forward kernel's key. What the region's backward does is not
    in that graph: whether each gradient (dgrad, wgrad) runs a cuDNN plan, called by a key of its
    own, or PyTorch's ops is chosen by timing in each process, and the gradient kernels' keys are
    this process's. A cache entry another process wrote (a shared Inductor cache directory,
    another plan cache) would replay that process's backward here: a gradient key this process
    never registered (``KeyError`` in ``run_region``), or one naming another kernel. Without
    AOTAutograd's cache each process traces its own backward; Inductor's FX graph cache still
    serves the forward and backward graphs, whose text holds every key they call (docs/
    decisions.md, "AOTAutograd's cache off for training glue").
    """
    from torch._functorch import config  # noqa: PLC0415
    from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

    with config.patch(enable_autograd_cache=False):
        return compile_fx(gm, list(example))


def glue_compiled(gm: fx.GraphModule, glue_backend: str,
                  training: bool) -> Callable[..., Any]:
    """``gm`` compiled by ``torch.compile`` with ``glue_backend`` (static shapes, one graph); in
    training by Inductor without AOTAutograd's cache (:func:`inductor_without_autograd_cache`)."""
    on_calling_thread("torch.compile of the glue")
    backend = (inductor_without_autograd_cache if training and glue_backend == "inductor"
               else glue_backend)
    return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)
