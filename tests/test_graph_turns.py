"""Threads sharing one training CUDA-graph pair take turns (``runtime/tensors.Turns``): no thread's
forward or backward reads buffers another thread's call is writing. CPU: the pair's graphs are
fakes whose replays compute on CPU tensors and can be held open."""

import threading

import pytest
import torch

from fusion_compiler.runtime.cuda_graph_training import _GraphPair
from fusion_compiler.runtime.tensors import Turns


class _Replay:
    """A fake graph: ``replay()`` runs ``fn``; while ``hold`` is set it first signals ``inside``
    and waits for ``leave``."""

    def __init__(self, fn):
        self.fn = fn
        self.hold, self.inside, self.leave = False, threading.Event(), threading.Event()

    def replay(self):
        if self.hold:
            self.inside.set()
            assert self.leave.wait(10)
        self.fn()

    def reset(self):
        pass


def _pair() -> _GraphPair:
    """y = 2x + 1 forward (activation a = 2x kept), dL/dx = g * a backward: a backward reading
    another call's activation returns another gradient."""
    pair = _GraphPair([], Turns(torch.device("cpu")))
    x, a, y = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    g, gx = torch.zeros(1), torch.zeros(1)
    pair.static_inputs, pair.static_outputs, pair.diff_positions = [x], [y], [0]
    pair.static_grad_outputs, pair.input_grads, pair.param_grads = [g], {0: gx}, []
    pair.fwd_graph = _Replay(lambda: (a.copy_(2 * x), y.copy_(a + 1)))
    pair.bwd_graph = _Replay(lambda: gx.copy_(g * a))
    return pair


def test_another_threads_forward_waits_for_a_backward_in_progress():
    """Thread A's backward replays while thread B calls forward on the same pair: B's forward
    (which overwrites the activations) waits, and A's gradient is that of its own input."""
    pair = _pair()
    outs, generation = pair.forward([torch.tensor([1.0])])
    assert outs[0].item() == 3.0
    pair.bwd_graph.hold = True
    grads = []
    a = threading.Thread(target=lambda: grads.append(pair.backward(generation,
                                                                   [torch.ones(1)])))
    a.start()
    assert pair.bwd_graph.inside.wait(10)
    other = []
    b = threading.Thread(target=lambda: other.append(pair.forward([torch.tensor([5.0])])))
    b.start()
    b.join(0.2)
    assert b.is_alive()  # waits for A's backward
    pair.bwd_graph.leave.set()
    a.join(10)
    b.join(10)
    assert grads[0][0][0].item() == 2.0  # dL/dx = a = 2 * 1, not 2 * 5
    assert other[0][0][0].item() == 11.0


def test_a_forward_in_progress_is_not_mixed_with_another_threads_input():
    """Thread A's forward replays while thread B calls forward: B's input copy waits, and each
    gets the output of its own input; the backward of the earlier one then raises."""
    pair = _pair()
    pair.fwd_graph.hold = True
    first, second = [], []
    a = threading.Thread(target=lambda: first.append(pair.forward([torch.tensor([1.0])])))
    a.start()
    assert pair.fwd_graph.inside.wait(10)
    pair.fwd_graph.hold = False
    b = threading.Thread(target=lambda: second.append(pair.forward([torch.tensor([5.0])])))
    b.start()
    b.join(0.2)
    assert b.is_alive()
    pair.fwd_graph.leave.set()
    a.join(10)
    b.join(10)
    (out_a, gen_a), (out_b, gen_b) = first[0], second[0]
    assert (out_a[0].item(), out_b[0].item()) == (3.0, 11.0) and gen_b == gen_a + 1
    with pytest.raises(RuntimeError, match="overwrote the activations"):
        pair.backward(gen_a, [torch.ones(1)])
    assert pair.backward(gen_b, [torch.ones(1)])[0][0].item() == 10.0


def test_a_backward_after_its_graphs_were_freed_says_so():
    """A backward whose pair was closed (captured again because a parameter was replaced)
    raises naming the cause, instead of returning gradients of freed buffers."""
    pair = _pair()
    _, generation = pair.forward([torch.tensor([1.0])])
    pair.close()
    with pytest.raises(RuntimeError, match="freed since its forward"):
        pair.backward(generation, [torch.ones(1)])


def test_a_thread_makes_the_libraries_handles_once_per_device_before_its_first_capture(
        monkeypatch):
    """``ready_to_capture``: each preparer runs once per (thread, device), one registered later
    on the next capture, and none while the current stream is being captured."""
    import contextlib

    from fusion_compiler.runtime import tensors

    ran = []
    monkeypatch.setattr(tensors, "_PREPARERS", [])
    monkeypatch.setattr(tensors, "_torch_library_handles", lambda i: ran.append(("torch", i)))
    monkeypatch.setattr(tensors.torch.cuda, "device", lambda i: contextlib.nullcontext())
    capturing = [False]
    monkeypatch.setattr(tensors, "stream_capturing", lambda: capturing[0])
    tensors.before_captures_on_a_thread(lambda i: ran.append(("cudnn", i)))

    def thread_body():
        tensors.ready_to_capture(0)
        tensors.ready_to_capture(0)
        tensors.ready_to_capture(1)

    for _ in range(2):  # two threads: each makes its own
        t = threading.Thread(target=thread_body)
        t.start()
        t.join()
    assert ran == [("torch", 0), ("cudnn", 0), ("torch", 1), ("cudnn", 1)] * 2
    ran.clear()
    capturing[0] = True
    t = threading.Thread(target=lambda: tensors.ready_to_capture(0))
    t.start()
    t.join()
    assert ran == []  # inside a capture nothing is made (it would fail)
    capturing[0] = False

    def registered_between():
        tensors.ready_to_capture(0)
        tensors.before_captures_on_a_thread(lambda i: ran.append(("later", i)))
        tensors.ready_to_capture(0)

    t = threading.Thread(target=registered_between)
    t.start()
    t.join()
    assert ran == [("torch", 0), ("cudnn", 0), ("later", 0)]
