"""What a captured inference graph hands out after a replay (``runtime/cuda_graph._Capture``):
"copies" gives fresh tensors equal to the output buffers; "safe" gives the buffers as new tensor
objects (copies where the buffers are never handed out); containers are new at every call and
keep their structure and non-tensor leaves. CPU: the graph is a fake whose replay adds one to
the buffers."""

import collections

import pytest
import torch
from torch.utils._pytree import tree_flatten

from fusion_compiler.runtime.cuda_graph import _Capture
from fusion_compiler.runtime.replays import GraphTurn
from fusion_compiler.runtime.tensors import StreamOrder

Pair = collections.namedtuple("Pair", "a b")


class _Graph:
    def __init__(self, buffers):
        self.buffers = buffers

    def replay(self):
        for t in self.buffers:
            t.add_(1)


def _capture(outputs, handed_out: bool) -> _Capture:
    capture = _Capture.__new__(_Capture)  # (the real constructor needs a CUDA stream)
    capture.outputs = outputs
    capture._leaves, capture._spec = tree_flatten(outputs)
    capture.graph = _Graph([t for t in capture._leaves if isinstance(t, torch.Tensor)])
    capture.turn, capture.order = GraphTurn(None), StreamOrder(torch.device("cpu"))
    capture.storages = [0] if handed_out else None
    return capture


OUTPUTS = {
    "tensor": lambda: torch.zeros(3),
    "tuple": lambda: (torch.zeros(2), 7, None),
    "dict": lambda: {"x": torch.zeros(2), "n": 3, "nested": [torch.ones(1), "s"]},
    "namedtuple": lambda: Pair(torch.zeros(2), torch.ones(2)),
}


@pytest.mark.parametrize("kind", sorted(OUTPUTS))
@pytest.mark.parametrize("mode", ["copies", "safe"])
def test_replay_hands_out_the_outputs_in_their_structure(kind, mode):
    outputs = OUTPUTS[kind]()
    capture = _capture(outputs, handed_out=True)
    first, second = capture.replay(mode), capture.replay(mode)
    flat, spec = tree_flatten(first)
    buffers, buffer_spec = tree_flatten(outputs)
    assert spec == buffer_spec
    if not isinstance(outputs, torch.Tensor):
        assert first is not outputs and first is not second  # a new container every call
    for got, buffer in zip(flat, buffers):
        if not isinstance(buffer, torch.Tensor):
            assert got == buffer
            continue
        assert got is not buffer
        shared = got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert shared == (mode == "safe")
        if mode == "copies":  # taken after the first replay: one more than the buffers' start
            assert torch.equal(got, buffer - 1)


def test_buffers_never_handed_out_are_copied_even_when_safe_is_asked():
    capture = _capture((torch.zeros(2),), handed_out=False)
    (got,) = capture.replay("safe")
    assert got.untyped_storage().data_ptr() != capture.outputs[0].untyped_storage().data_ptr()
