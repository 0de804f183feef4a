"""Other threads beside a compile: while this package traces a model and propagates its shapes,
another thread's modules, ``torch.compile``'d functions and the model's own state are as they
would be without the compile (docs/architecture.md, "Background work")."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import fusion_compiler
from fusion_compiler.capture import capture
from fusion_compiler.shapes import propagate_shapes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1))


def test_other_threads_call_modules_and_compiled_functions_while_a_model_is_traced():
    other = _net().eval()
    post = torch.compile(lambda t: t.sin() + 1, backend="eager")
    x, v = torch.randn(2, 3, 8, 8), torch.randn(5)
    want = (other(x), post(v))
    seen: list = []

    def elsewhere() -> None:
        try:
            seen.append((other(x), post(v)))
        except Exception as exc:  # what the thread met, for the assertion below
            seen.append(exc)

    class Traced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            if isinstance(inp, torch.fx.Proxy):  # while fx traces: another thread's calls
                worker = threading.Thread(target=elsewhere)
                worker.start()
                worker.join()
            return torch.relu(self.conv(inp))

    model = Traced()
    compiled = fusion_compiler.compile(model)  # traces now, and again at the first call
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(seen) >= 2
    for got in seen:
        assert not isinstance(got, Exception), f"{type(got).__name__}: {got}"
        assert isinstance(got[0], torch.Tensor) and torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])


def test_compiled_functions_of_other_threads_run_while_fx_lists_the_modules():
    # fx lists the model's modules (``named_modules``) just after raising its tracing flag;
    # from then on the flag must read as lowered on every other thread
    post = torch.compile(lambda t: t.cos() * 2, backend="eager")
    v = torch.randn(5)
    want = post(v)
    seen: list = []

    def elsewhere() -> None:
        try:
            seen.append(post(v))
        except Exception as exc:  # what the thread met, for the assertion below
            seen.append(exc)

    class Listed(nn.Sequential):
        def named_modules(self, *args, **kwargs):
            worker = threading.Thread(target=elsewhere)
            worker.start()
            worker.join()
            return super().named_modules(*args, **kwargs)

    model = Listed(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(fusion_compiler.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
    assert seen
    for got in seen:
        assert not isinstance(got, Exception), f"{type(got).__name__}: {got}"
        assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["real", "meta", "fake"])
def test_shape_propagation_leaves_the_models_tensors_alone(how):
    """A trainer thread's batch-norm updates made while another thread's call propagates shapes
    stay: the propagation writes none of the model's tensors (it used to update them and put the
    old values back) and swaps none of its parameters for meta tensors."""
    model = _net().train()
    state = model.state_dict(keep_vars=True)
    before = {name: (t, t._version, t.clone()) for name, t in state.items()}
    conv = model[0]
    devices = []
    conv.register_forward_pre_hook(lambda module, args: devices.append(conv.weight.device))
    gm = capture(model)
    x = torch.randn(2, 3, 8, 8)
    if how == "fake":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            propagate_shapes(gm, [x])
    else:
        propagate_shapes(gm, [x], real=how == "real")
    assert gm.graph.find_nodes(op="output")[0].meta.get("val") is not None
    for name, t in model.state_dict(keep_vars=True).items():
        obj, version, value = before[name]
        assert t is obj and t._version == version and torch.equal(t, value), name
    assert all(d.type == "cpu" for d in devices)
    assert int(model[1].num_batches_tracked) == 0
