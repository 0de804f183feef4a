"""What a captured inference graph hands out after a replay (``runtime/captured.CapturedForward``):
"copies" gives fresh tensors equal to the output buffers; "safe" gives the buffers as new tensor
objects (copies where the buffers are never handed out); containers are new at every call and
keep their structure and non-tensor leaves. CPU: the graph is a fake whose replay adds one to
the buffers. And a compiled call's output has the container classes forward made."""

import collections

import pytest
import torch
from torch.utils._pytree import tree_flatten

import fusion_compiler
from fusion_compiler.runtime.captured import CapturedForward, input_aliases
from fusion_compiler.runtime.replays import GraphTurn
from fusion_compiler.runtime.tensors import StreamOrder

Pair = collections.namedtuple("Pair", "a b")


class _Graph:
    def __init__(self, buffers):
        self.buffers = buffers

    def replay(self):
        for t in self.buffers:
            t.add_(1)


def _capture(outputs, handed_out: bool, inputs=(), state=()) -> CapturedForward:
    capture = CapturedForward.__new__(CapturedForward)  # (the constructor needs a CUDA stream)
    capture.outputs, capture.state = outputs, list(state)
    capture._leaves, capture._spec = tree_flatten(outputs)
    capture.aliases = input_aliases(capture._leaves, [*inputs, *state])
    capture.graph = _Graph([t for k, t in enumerate(capture._leaves)
                            if isinstance(t, torch.Tensor) and k not in capture.aliases])
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
    first, second = capture.replay(mode, ()), capture.replay(mode, ())
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
    (got,) = capture.replay("safe", ())
    assert got.untyped_storage().data_ptr() != capture.outputs[0].untyped_storage().data_ptr()


@pytest.mark.parametrize("mode", ["copies", "safe"])
def test_outputs_that_are_inputs_are_the_callers_tensors(mode):
    """An output that is the capture's input buffer (or a view of it) comes back as the caller's
    tensor (or the same view of it), not the buffer or a copy: eager returns the caller's
    tensor, and a write into it must reach the caller (a channel slice of a larger tensor, say).
    The graph's own outputs are handed out as before."""
    buffer, y = torch.zeros(2, 3, 4), torch.zeros(5)
    capture = _capture((y, buffer, 7), handed_out=True, inputs=[buffer])
    big = torch.zeros(2, 6, 4)
    caller = big[:, :3]  # strided with gaps: the whole input fits any layout
    assert capture.fits([caller])
    got_y, got_x, n = capture.replay(mode, [caller])
    assert got_x is caller and n == 7 and got_y.eq(1.0).all()  # (the fake adds one)
    got_x.fill_(3.0)
    assert big[:, :3].eq(3.0).all() and big[:, 3:].eq(0.0).all()

    viewed = _capture((buffer[:, 1:],), handed_out=True, inputs=[buffer])
    assert not viewed.fits([caller])  # a view needs the capture's strides
    caller = torch.zeros(2, 3, 4)
    (got,) = viewed.replay(mode, [caller])
    assert got.data_ptr() == caller[:, 1:].data_ptr() and got.stride() == caller[:, 1:].stride()
    assert got.shape == caller[:, 1:].shape


@pytest.mark.parametrize("mode", ["copies", "safe"])
def test_outputs_that_are_the_models_state_are_those_tensors(mode):
    """``return y, self.calls``: eager returns the buffer itself, a replay handed out a copy
    (session 53's GPU suite). An output that is a tensor of the model's state (or a view of one)
    is that tensor (or the same view), beside inputs returned as the caller's."""
    calls, weight, buffer = torch.zeros(()), torch.zeros(4, 2), torch.zeros(3)
    capture = _capture((torch.zeros(2), calls, weight.t(), buffer), handed_out=True,
                       inputs=[buffer], state=[calls, weight])
    caller = torch.zeros(3)
    assert capture.fits([caller])
    got_y, got_calls, got_t, got_x = capture.replay(mode, [caller])
    assert got_calls is calls and got_x is caller and got_y.eq(1.0).all()
    assert got_t.data_ptr() == weight.data_ptr() and got_t.stride() == weight.t().stride()


def test_input_aliases_names_whole_inputs_and_views():
    x, w = torch.zeros(2, 3), torch.zeros(4)
    found = input_aliases([torch.ones(1), x, x.t(), w.view(torch.int32), "s"], [w, x])
    assert found == {1: (1, (3, 1), None), 2: (1, (3, 1), ((3, 2), (1, 3), 0)),
                     3: (0, None, ((4,), (1,), 0))}


def test_cpu_results_names_a_returned_or_written_cpu_tensor_only():
    """What keeps a GPU forward out of a CUDA graph (``graphing._cpu_results``): a CPU tensor
    it returns or writes in place (a capture runs CPU ops once); CPU values that feed GPU work
    only do not count. CPU: the GPU's values are marked by hand on a CPU graph."""
    import torch.fx as fx

    from fusion_compiler.graphing import _cpu_results
    from fusion_compiler.shapes import propagate_shapes

    class M(torch.nn.Module):
        def forward(self, x):
            return x * 3, torch.ones(2) * x.shape[0]  # a CPU value the graph computes

    gm = fx.symbolic_trace(M())
    propagate_shapes(gm, [torch.randn(2, 2)])
    (made,) = [n for n in gm.graph.nodes if any(a.op == "get_attr" for a in n.all_input_nodes)]
    for node in gm.graph.nodes:  # everything else on the GPU
        if node is not made:
            node.meta["device"] = torch.device("cuda")
    assert _cpu_results(gm) == made.name
    made.meta["device"] = torch.device("cuda")
    assert _cpu_results(gm) == ""


class _Scores(dict):
    """A dict class of the user's (a results object)."""


class _Tagged(tuple):
    """A tuple class of the user's that is no named tuple."""


class _Containers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        counts = collections.defaultdict(int)
        counts["n"] = y.sum()
        heads = collections.OrderedDict([("out", y), ("aux", y.mean())])
        return {"heads": heads, "counts": counts, "scores": _Scores(s=y.amax()),
                "tagged": _Tagged((y, y + 1)), "pair": Pair([heads], 3)}


def test_the_output_keeps_the_container_classes_forward_made():
    """fx writes each dict of the output as a dict and a tuple of the user's class as a tuple:
    torchvision's segmentation models return an OrderedDict, which came back a dict
    (helper-57). Each container has forward's class again, nested ones too, items as eager's."""
    torch.manual_seed(0)
    model, x = _Containers().eval(), torch.randn(1, 3, 6, 6)
    compiled = fusion_compiler.compile(model)
    with torch.no_grad():
        for _ in range(2):
            got, want = compiled(x), model(x)
            assert type(got) is dict and got.keys() == want.keys()
            for key in want:
                assert type(got[key]) is type(want[key]), key
            assert got["counts"].default_factory is int and got["counts"]["missing"] == 0
            assert list(got["heads"]) == ["out", "aux"]
            assert type(got["pair"].a[0]) is collections.OrderedDict and got["pair"].b == 3
            torch.testing.assert_close(got["tagged"][1], want["tagged"][1])
            torch.testing.assert_close(got["scores"]["s"], want["scores"]["s"])
