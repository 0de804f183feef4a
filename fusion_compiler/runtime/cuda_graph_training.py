"""Replay a training specialization's forward and backward as a pair of CUDA graphs.

What :class:`TrainingGraphRunner` keeps of plain autograd:

- **Gradients reach ``.grad`` through autograd.** One ``torch.autograd.Function`` per graph pair
  takes the pair's inputs and the parameters it reads that require grad; its backward replays the
  backward graph and returns the gradients, which autograd's ``AccumulateGrad`` adds into ``.grad``
  as for any op, so micro-batch accumulation, ``zero_grad`` in either form and
  DistributedDataParallel's gradient hooks work unchanged. The returned gradients are fresh copies
  of the graph's buffers (one ``torch._foreach_copy_`` into tensors laid out like their parameters),
  never the buffers themselves: ``torch.cuda.make_graphed_callables`` returns its buffers,
  ``AccumulateGrad`` may keep one as ``.grad``, and the next replay then overwrites an accumulated
  gradient (pytorch/pytorch#181723). Inside the graph each gradient is made to the strides of its
  parameter, so DDP's buckets take them without a layout copy.
- **Parameters are read in place.** The graphs read parameters and buffers at their addresses, so
  an optimizer's in-place update is seen by the next replay. Replacing a parameter tensor, or
  changing which parameters require grad, captures the graphs again (checked before each forward).
- **Buffers see one update per call.** Warm-up runs (which update BatchNorm's running statistics)
  are undone: the buffers are restored after capture.
- **Outputs survive later calls**: each forward returns copies of the graph's output buffers.
- **Threads take turns** (:class:`~.tensors.Turns`): a forward's copies, replay and copies out,
  and a backward's, run one at a time and in stream order, so two threads' calls never mix their
  inputs, activations or gradients; a forward of another thread between a forward and its
  backward makes that backward raise (below), as any later forward does.

Limits (each raises ``RuntimeError`` naming the fix): a backward must follow its own forward
before the next forward of the same specialization (the forward graph's saved activations are
overwritten by the next replay), and once (``retain_graph`` does not keep them); no double backward
(``create_graph=True``).

Capture is that of :mod:`.cuda_graph` (warm-up on a side stream, then ``torch.cuda.graph`` with
thread-local error mode). The two graphs share one memory pool, captured in the order they
replay (the pattern of ``torch.cuda.make_graphed_callables``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from .replays import GraphTurn
from .tensors import Turns, layout_like, output_leaves, restored, side_stream
from ..ir.errors import condense
from .cuda_graph import CaptureError, _uncached_autocast, capturing
from .weight_cache import derivation_epoch
from .background import COMPILE_LOCK

__all__ = ["TrainingGraphRunner"]


class TrainingGraphRunner:
    """Capture ``fn``'s forward and backward for inputs like ``example_args`` as CUDA graphs.

    Args:
        fn: the training forward (tensors in, a pytree of tensors out); it must launch work only
            on the current stream and must not synchronize with the host.
        module: the module through which ``fn`` reads ``parameters`` (``fn`` calls it): warm-up
            and capture swap its parameters for aliases (``torch.func.functional_call``), see
            :meth:`_aliases`.
        example_args: real CUDA tensors (and other values passed as they are); a tensor's
            ``requires_grad`` says whether its gradient is computed.
        parameters: the parameters ``fn`` reads (those that require grad get gradients).
        buffers: the buffers ``fn`` may update in place (restored after warm-up and capture).
        warmup: forward + backward runs on a side stream before capture.

    The graphs are captured on this package's training capture stream of the current device, of
    the default priority (as DistributedDataParallel's communication beside the backward), which
    every model's training steps share: that stream is their lane (:mod:`.replays`), so they
    replay in turn with one another and may replay beside inference graphs.

    Raises:
        CaptureError: the forward or the backward cannot be captured.
    """

    def __init__(self, fn: Callable[..., Any], module: torch.nn.Module,
                 example_args: Sequence[Any], parameters: Sequence[torch.nn.Parameter],
                 buffers: Sequence[torch.Tensor] = (), warmup: int = 3):
        self.fn, self.module, self.warmup = fn, module, warmup
        self.stream = side_stream("training capture")
        self.all_parameters = list(parameters)
        self.buffers = list(buffers)
        self.static_inputs = [a.detach().clone().requires_grad_(a.requires_grad)
                              if isinstance(a, torch.Tensor) else a for a in example_args]
        self.pair: _GraphPair | None = None
        self._turns = Turns(torch.device("cuda", torch.cuda.current_device()))
        self._capturing = threading.RLock()  # one capture at a time, none under a replay's turn
        self._capture()

    def _token(self) -> tuple:
        return tuple((p.data_ptr(), p.requires_grad) for p in self.all_parameters)

    def _capture(self) -> None:
        self.close()
        self.token = self._token()
        self.parameters = [p for p in self.all_parameters if p.requires_grad]
        named, aliases = self._aliases()
        wrt = [a for a in self.static_inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        try:
            with restored(self.buffers):
                self._warm_up(named, wrt + aliases)
                named, aliases = self._aliases()  # leaves the warm-up never saw (see _warm_up)
                with derivation_epoch() as self._epoch, COMPILE_LOCK:  # kept with the graphs
                    self._capture_graphs(named, dict(zip(map(id, self.parameters), aliases)))
        except Exception as exc:  # cudaErrorStreamCapture*, or the step's own error
            self.close()
            self.token = None  # a later call tries again (and says why, if it fails again)
            raise CaptureError(condense(f"{type(exc).__name__}: {exc}", limit=300)) from exc

    def _aliases(self) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """New leaf tensors sharing each parameter's storage, by name in ``module`` (for
        ``functional_call``), and those of the parameters that require grad, in order.

        Warm-up and capture differentiate with respect to these, never the parameters
        themselves: hooks on a parameter's gradient accumulator (DistributedDataParallel's
        all-reduce, a user's) must not run then (DDP's enqueue work outside the capture stream,
        which invalidates the capture), and they run as usual when a replay's gradients are
        accumulated. The graphs read the same storage, so updates in place are seen."""
        read = list(self.module.named_parameters(remove_duplicate=False))
        params = {id(p): p for p in (*self.all_parameters, *(p for _, p in read))}
        alias = {key: p.detach().requires_grad_(p.requires_grad) for key, p in params.items()}
        return ({name: alias[id(p)] for name, p in read},
                [alias[id(p)] for p in self.parameters])

    def _run(self, named: dict[str, torch.Tensor]) -> Any:
        return torch.func.functional_call(_Bound(self.module, self.fn), {
            f"module.{name}": t for name, t in named.items()}, tuple(self.static_inputs))

    def _warm_up(self, named: dict[str, torch.Tensor], wrt: list[torch.Tensor]) -> None:
        """Forward and backward runs on a side stream, autocast's cast cache off.

        Autograd records the stream on which a leaf's ``AccumulateGrad`` node was made and, in a
        later backward, makes the producing stream wait for that one. A node made here and kept
        alive into the capture (autocast's cache keeps the cast of a leaf that requires grad, and
        with it the leaf's node, until the outermost autocast region exits) pulls this stream,
        which is not capturing, into the capture: the capture fails with
        ``cudaErrorStreamCaptureInvalidated`` (pytorch/pytorch#180090). So nothing is cached
        here, and the capture differentiates with respect to new aliases of the parameters
        (docs/decisions.md, "Training graphs return copies of the gradients")."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.enable_grad(), _uncached_autocast():
            for _ in range(self.warmup):
                outs = _differentiable(tree_flatten(self._run(named))[0])
                if outs and wrt:
                    torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs],
                                        allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)

    def _capture_graphs(self, named: dict[str, torch.Tensor],
                        alias_of: dict[int, torch.Tensor]) -> None:
        pool = torch.cuda.graph_pool_handle()
        # closed if it fails
        self.pair = pair = _GraphPair(self.parameters, self._turns, self.stream)
        with torch.enable_grad():
            pair.capture_forward(lambda: self._run(named), self.static_inputs, pool)
        pair.capture_backward([alias_of[id(p)] for p in pair.parameters],
                              set(map(id, alias_of.values())), pool)

    # ------------------------------------------------------------------ calls
    def __call__(self, *args: Any) -> Any:
        with self._capturing:
            if self._token() != self.token:
                self._capture()
            pair = self.pair
        flat = _Replay.apply(pair, len(args), *args, *pair.parameters)
        return tree_unflatten(list(flat), pair.out_spec)

    def close(self) -> None:
        """Free the graphs and their memory pool: not during another thread's capture or replay,
        and after the work of the last replay's stream (the current stream waits for it)."""
        with self._capturing, self._turns.closing():
            if self.pair is not None:
                self.pair.close()
            self.pair = None
            self._epoch = None


class _GraphPair:
    """The forward and backward graphs of the step, their static buffers and replays."""

    def __init__(self, parameters: list[torch.nn.Parameter], turns: Turns,
                 stream: torch.cuda.Stream | None = None):
        self.parameters, self.turns, self.stream = parameters, turns, stream
        self.fwd_turn, self.bwd_turn = GraphTurn(stream), GraphTurn(stream)  # (their lane)
        self.closed = False
        self.fwd_graph: torch.cuda.CUDAGraph | None = None
        self.bwd_graph: torch.cuda.CUDAGraph | None = None
        self.generation = 0  # forward replays so far: a backward must belong to the latest

    def capture_forward(self, call: Callable[[], Any], inputs: list[Any], pool: Any) -> Any:
        """Capture ``call()`` reading ``inputs`` (kept as the static inputs); return its output
        with autograd history (what the backward capture differentiates)."""
        self.inputs = inputs
        self.static_inputs = [x.detach() if isinstance(x, torch.Tensor) else x for x in inputs]
        self.fwd_graph = torch.cuda.CUDAGraph()
        with capturing(self.fwd_graph, self.turns, pool, self.stream):
            out = call()
        self.live_outputs, self.out_spec = output_leaves(out)
        self.diff_positions = [i for i, t in enumerate(self.live_outputs)
                               if isinstance(t, torch.Tensor) and t.requires_grad]
        self.static_outputs = [t.detach() if isinstance(t, torch.Tensor) else t
                               for t in self.live_outputs]
        return out

    def capture_backward(self, aliases: list[torch.Tensor], alias_ids: set[int],
                         pool: Any) -> None:
        """Capture the gradients of the diff inputs and of ``aliases`` (this pair's parameters)
        given gradients of the diff outputs; an input that is a parameter's alias (its id in
        ``alias_ids``) gets its gradient laid out like it."""
        outs = [self.live_outputs[i] for i in self.diff_positions]
        self.static_grad_outputs = [torch.empty_like(o) for o in outs]
        positions = [i for i, x in enumerate(self.inputs)
                     if isinstance(x, torch.Tensor) and x.requires_grad]
        wrt = [self.inputs[i] for i in positions] + aliases
        n = len(positions)
        if not (outs and wrt):  # nothing to differentiate: no graph (an empty capture warns)
            self.input_grads, self.param_grads = dict.fromkeys(positions), [None] * len(aliases)
            self.live_outputs, self.inputs = [], []
            return
        self.bwd_graph = torch.cuda.CUDAGraph()
        # no capture turn: autograd runs these nodes on its device thread, which may be waiting
        # for that turn in another thread's backward replay (a deadlock; docs/decisions.md,
        # "Captures take their turn")
        with capturing(self.bwd_graph, self.turns, pool, self.stream, turn=False):
            grads = torch.autograd.grad(outs, wrt, self.static_grad_outputs, allow_unused=True)
            grads = [*(layout_like(g, self.inputs[i], copy=True)
                       if g is not None and id(self.inputs[i]) in alias_ids else g
                       for g, i in zip(grads[:n], positions)),
                     *(None if g is None else layout_like(g, p, copy=True)
                       for g, p in zip(grads[n:], self.parameters))]
        self.input_grads = dict(zip(positions, (None if g is None else g.detach()
                                                for g in grads[:n])))
        self.param_grads = [None if g is None else g.detach() for g in grads[n:]]
        self.live_outputs, self.inputs = [], []  # the capture's autograd graph is spent

    def forward(self, inputs: Sequence[Any]) -> tuple[list[Any], int]:
        """Copy ``inputs`` into the static buffers (where they are other tensors), replay the
        forward graph; return copies of the outputs (flattened) and the replay's generation."""
        with self.turns.turn():
            self._refuse_closed("forward")
            for static, a in zip(self.static_inputs, inputs):
                if isinstance(a, torch.Tensor) and a.data_ptr() != static.data_ptr():
                    static.copy_(a)
            with self.fwd_turn.replaying():
                self.fwd_graph.replay()
            self.generation += 1
            return ([t.clone() if isinstance(t, torch.Tensor) else t
                     for t in self.static_outputs], self.generation)

    def _refuse_closed(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"fusion_compiler: {what} of a CUDA-graphed training call whose graphs were freed "
                "since its forward (the compiled module captured them again: a parameter was "
                "replaced or its requires_grad changed; or it was closed). Call backward before "
                "changing the parameters, or compile with cuda_graph=False.")

    def backward(self, generation: int, grad_outputs: Sequence[torch.Tensor | None]
                 ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Replay the backward graph for the forward replay ``generation`` with these output
        gradients (``None``: zero); return fresh copies of the input gradients (by position)
        and of the parameter gradients."""
        with self.turns.turn():
            self._refuse_closed("backward")
            return self._backward(generation, grad_outputs)

    def _backward(self, generation: int, grad_outputs: Sequence[torch.Tensor | None]
                  ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        if generation != self.generation:
            raise RuntimeError(
                "fusion_compiler: backward of a CUDA-graphed training call after a later call of "
                "the same compiled module: that call's replay overwrote the activations this "
                "backward needs. Call backward before the next forward (accumulate gradients "
                "over micro-batches one forward + backward at a time), or compile with "
                "cuda_graph=False.")
        self.generation += 1  # a second backward of the same forward is refused too
        for static, g in zip(self.static_grad_outputs, grad_outputs):
            if g is None:
                static.zero_()
            elif g.data_ptr() != static.data_ptr():
                static.copy_(g)
        if self.bwd_graph is not None:
            with self.bwd_turn.replaying():
                self.bwd_graph.replay()
        copied = [g for g in self.input_grads.values() if g is not None]
        copied += [g for g in self.param_grads if g is not None]
        fresh = [torch.empty_like(g) for g in copied]
        if fresh:
            torch._foreach_copy_(fresh, copied)
        it = iter(fresh)
        inputs = {i: None if g is None else next(it) for i, g in self.input_grads.items()}
        return ([inputs.get(i) for i in range(len(self.static_inputs))],
                [None if g is None else next(it) for g in self.param_grads])

    def close(self) -> None:
        self.closed = True
        for graph in (self.fwd_graph, self.bwd_graph):
            if graph is not None:
                graph.reset()
        self.fwd_graph = self.bwd_graph = None
        self.static_outputs, self.static_grad_outputs, self.param_grads = [], [], []
        self.input_grads, self.live_outputs, self.inputs = {}, [], []


def _differentiable(flat: list[Any]) -> list[torch.Tensor]:
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


class _Bound(torch.nn.Module):
    """``fn`` as the forward of a module holding ``module``, for ``functional_call``."""

    def __init__(self, module: torch.nn.Module, fn: Callable[..., Any]):
        super().__init__()
        self.module = module
        # not registered: ``fn`` may be ``module`` itself (or a torch.compile wrapper of it), and
        # registered twice its parameters would have two names, only one of them swapped
        object.__setattr__(self, "fn", fn)

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class _Replay(torch.autograd.Function):
    """Autograd's view of one graph pair's replay: inputs are the pair's inputs, then the
    parameters it reads that require grad; outputs the flattened outputs of its forward."""

    @staticmethod
    def forward(ctx, pair: _GraphPair, n_inputs: int, *tensors: Any):
        ctx.pair = pair
        inputs = tensors[:n_inputs]
        outs, ctx.generation = pair.forward(inputs)
        ctx.input_requires = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
        diff = set(pair.diff_positions)
        ctx.mark_non_differentiable(*(t for i, t in enumerate(outs)
                                      if isinstance(t, torch.Tensor) and i not in diff))
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        pair = ctx.pair
        inputs, params = pair.backward(ctx.generation,
                                       [grad_outputs[i] for i in pair.diff_positions])
        input_grads = [g if needs else None for g, needs in zip(inputs, ctx.input_requires)]
        return (None, None, *input_grads, *params)
