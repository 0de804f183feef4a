"""The ``fusion_compiler::run_region`` custom op: how a lowered region is called from a graph.

Going through ``torch.library`` gives every region a fake (meta) implementation, so
``torch.compile``, ``torch.export`` and ``FakeTensor`` propagation see output shapes, strides and
dtypes without running cuDNN. Kernels are registered under an integer key, a hash of what the kernel
computes (its class, a name its backend gives, the output specs; the next free integer on a
collision), not a count of the kernels the process registered before: Inductor's FX graph cache
keys a glue graph by its text, keys included, so a warm process finds the graph a cold one
compiled although autotuning built a different number of kernels there. The registry holds
kernels weakly, so a region's kernel lives exactly as long as the compiled module that owns it.

Autograd: a kernel registered with a backward (:func:`register_backward`, a
:class:`fusion_compiler.autograd.backward.RegionBackward` for lowered regions) is differentiable.
The op saves its inputs and outputs (a region compiled for training returns the values its backward
reads as extra outputs) and calls the backward with the output gradients (``None`` for outputs
nothing read). Calling a kernel compiled for inference while gradients are needed raises
``RuntimeError`` in the backward pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from typing import Callable, Sequence

import torch

from .background import ThreadFlag
from .weight_cache import note_reads

__all__ = ["run_region", "register_kernel", "register_backward", "is_traced", "dry_run",
           "in_dry_run", "channels_last_specs"]

_KERNELS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_OUTPUTS: dict[int, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]] = {}
_BACKWARD_ATTR = "_fusion_compiler_backward"
_KEY_LOCK = threading.Lock()  # kernels are registered on the calling and the background thread
_DRY = ThreadFlag()


@contextlib.contextmanager
def dry_run():
    """On this thread, make :func:`run_region` return uninitialized outputs of the right shapes
    without running the kernel: a background compile that runs its compiled graph once (Triton's
    autotuning happens at the first run) then leaves the regions' plans and workspaces alone,
    which a CUDA graph of another thread may be replaying
    (:mod:`fusion_compiler.runtime.tiered`)."""
    with _DRY.raised():
        yield


def in_dry_run() -> bool:
    """Whether this thread is inside :func:`dry_run`."""
    return bool(_DRY)


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracing tensor (FakeTensor, FunctionalTensor, ...: any subclass but a
    Parameter) rather than real data, or Dynamo is tracing: then a region must be called through
    :func:`run_region`, which tracing sees as one opaque op with known output metadata.
    (``is_dynamo_compiling``, not ``is_compiling``: the latter also reads a process-wide flag,
    which a trace on another thread, a background compile, may set.)"""
    return torch.compiler.is_dynamo_compiling() or type(t) not in (torch.Tensor,
                                                                     torch.nn.Parameter)


def channels_last_specs(outputs: Sequence[tuple[Sequence[int], torch.dtype]]
                        ) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """``(shape, stride, dtype)`` of outputs ``(shape, dtype)`` laid out fully packed
    channels_last when 4-d (contiguous otherwise): what :func:`register_kernel` takes for a
    kernel that writes its outputs so."""
    specs = []
    for shape, dtype in outputs:
        empty = torch.empty(tuple(shape), device="meta")
        if empty.dim() == 4:
            empty = empty.contiguous(memory_format=torch.channels_last)
        specs.append((tuple(shape), tuple(empty.stride()), dtype))
    return specs


def register_kernel(kernel: object,
                    outputs: Sequence[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]],
                    name: str = "") -> int:
    """Register ``kernel`` (callable: tensors -> tuple of tensors) and the ``(shape, stride,
    dtype)`` of each output it returns; returns the key to pass to :func:`run_region`: a 56-bit
    hash of the kernel's class name, ``name`` (what tells apart the kernels of one graph, e.g.
    the region's id) and ``outputs``, or the next integer not in use."""
    text = repr((type(kernel).__qualname__, name, [(tuple(shape), tuple(stride), str(dtype))
                                                   for shape, stride, dtype in outputs]))
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
    with _KEY_LOCK:
        while key in _OUTPUTS:
            key += 1
        _KERNELS[key] = kernel
        _OUTPUTS[key] = list(outputs)
    weakref.finalize(kernel, _OUTPUTS.pop, key, None)
    return key


def register_backward(key: int, backward: Callable) -> None:
    """Make the kernel under ``key`` differentiable.

    ``backward(needs_grad, inputs, outputs, grad_outputs) -> list[Tensor | None]``: ``needs_grad``
    has one bool per input, ``grad_outputs`` one tensor or ``None`` per output; it returns one
    gradient (or ``None``) per input, shaped like that input. It is kept on the kernel object (not
    in a global table), so it lives exactly as long as the kernel.
    """
    setattr(_KERNELS[key], _BACKWARD_ATTR, backward)


@torch.library.custom_op("fusion_compiler::run_region", mutates_args=())
def run_region(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the kernel registered under ``key`` on ``inputs``; returns fresh output tensors
    (uninitialized ones, the kernel not run, inside :func:`dry_run`)."""
    if _DRY:
        return _run_region_fake(key, inputs)
    kernel: Callable = _KERNELS[key]
    note_reads(inputs)
    return list(kernel(*inputs))


@run_region.register_fake
def _run_region_fake(key: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    device = inputs[0].device
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype in _OUTPUTS[key]]


def _setup_context(ctx, inputs, output):
    key, tensors = inputs
    ctx.key = key
    ctx.n_inputs = len(tensors)
    ctx.save_for_backward(*tensors, *output)
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    backward = getattr(_KERNELS.get(ctx.key), _BACKWARD_ATTR, None)
    if backward is None:
        raise RuntimeError("this fused region was compiled for inference (no gradients were "
                           "needed when it was specialized); call the compiled module with "
                           "gradients enabled to get a training specialization")
    saved = ctx.saved_tensors
    inputs, outputs = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
    if not torch.is_grad_enabled() or getattr(backward, "differentiable", False):
        # the usual backward (``create_graph=False``), or one made of differentiable ops
        return None, list(backward(list(ctx.needs_input_grad[1]), inputs, outputs, list(grads)))
    # create_graph=True (a gradient penalty) through kernels that are not differentiable (cuDNN
    # dgrad and wgrad): its gradients would silently count as constants in a second derivative.
    # They are returned as they are, but differentiating them raises, as @once_differentiable
    with torch.no_grad():
        result = list(backward(list(ctx.needs_input_grad[1]), inputs, outputs, list(grads)))
    tensors = [i for i, g in enumerate(result) if isinstance(g, torch.Tensor)]
    if tensors:
        marked = _NOT_TWICE(_SECOND_DERIVATIVE, len(tensors))(
            *[result[i].detach().requires_grad_() for i in tensors])
        for i, g in zip(tensors, marked if isinstance(marked, tuple) else (marked,)):
            result[i] = g
    return None, result


_SECOND_DERIVATIVE = (b"fusion_compiler: a second derivative through a fused region (a backward "
                      b"with create_graph=True, then a backward through its gradients, as a "
                      b"gradient penalty does) is not supported: the region's backward kernels "
                      b"are not differentiable. Compute this loss with the uncompiled module")
_NOT_TWICE = torch._C._functions.DelayedError  # what @once_differentiable marks gradients with


run_region.register_autograd(_backward, setup_context=_setup_context)
