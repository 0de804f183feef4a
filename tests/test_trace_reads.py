"""What a traced ``forward`` reads besides its tensors, that a compiled graph keeps: process state
is named in one WARNING, an alias of ``torch.is_grad_enabled`` gets a specialization per grad
mode, and a ``torch.nn`` submodule's ``training`` flag that the parent reads is in the key."""

import copy
import itertools
import logging
import os
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch import is_grad_enabled

import fusion_compiler
from fusion_compiler import FusionError


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)


class _ReadsState(_Base):
    def forward(self, x):
        y = self.conv(x)
        if os.environ.get("FC_TEST_FLAG") == "1":
            y = y + 1
        if time.time() < 0:  # (a clock, read once by the trace)
            y = y * 0
        return y.to(torch.get_default_dtype())


def test_process_state_forward_reads_is_named_in_one_warning(caplog):
    model, x = _ReadsState().eval(), torch.randn(1, 3, 8, 8)
    compiled = fusion_compiler.compile(model)
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        compiled(x)
        compiled(torch.randn(2, 3, 8, 8))  # another specialization: traced again, not told again
    told = [r.getMessage() for r in caplog.records if "reads os.environ" in r.getMessage()]
    assert len(told) == 1, told
    assert "torch.get_default_dtype" in told[0] and "time.time" in told[0]
    assert "a change after this compile is not seen" in told[0]


STEPS = itertools.count(1)


class _TakesASteps(_Base):
    def forward(self, x):
        return self.conv(x) * next(STEPS)


def test_a_module_level_iterator_forward_reads_is_refused_before_the_trace_takes_an_item():
    """The graph kept the trace's item for every call (helper-50: a ratio of 1.0 at every call
    where eager gave 2, 3, 4)."""
    with pytest.raises(FusionError, match="reads STEPS, an iterator at module level"):
        fusion_compiler.compile(_TakesASteps())
    assert next(STEPS) == 1


class _AliasOfGradMode(_Base):
    def forward(self, x):
        y = self.conv(x)
        return y + 1000 if is_grad_enabled() else y


def test_an_alias_of_the_grad_mode_query_gets_a_specialization_per_mode():
    model, x = _AliasOfGradMode().eval(), torch.randn(1, 3, 8, 8)
    compiled = fusion_compiler.compile(model)
    torch.testing.assert_close(compiled(x), model(x))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x))


class _ReadsSubmoduleMode(_Base):
    def forward(self, x):
        y = self.conv(x)
        return y + 1000 if self.conv.training else y


def test_a_submodules_training_flag_the_parent_reads_is_in_the_key():
    """``model.conv.eval()`` alone (the root stays in training mode) changes what the parent's
    code computes."""
    model, x = _ReadsSubmoduleMode().train(), torch.randn(1, 3, 8, 8)
    compiled = fusion_compiler.compile(model)
    torch.testing.assert_close(compiled(x), model(x))
    model.conv.eval()
    torch.testing.assert_close(compiled(x), model(x))


class _ReadsAutogradState(_Base):
    def forward(self, x):
        y = self.conv(x)
        return y + 1000 if x.grad_fn is None else y


class _ReadsATag(_Base):
    def forward(self, x):
        y = self.conv(x)
        return y + 1000 if hasattr(x, "_tag") else y


@pytest.mark.parametrize("model, name", [(_ReadsAutogradState, "grad_fn"), (_ReadsATag, "_tag")])
def test_reads_of_what_a_graph_cannot_answer_per_call_are_refused_naming_them(model, name):
    """fx answers ``x.grad_fn`` with a node (never ``None``) and ``hasattr(x, "_tag")`` with
    ``True``, once for all calls: eager's answer differs."""
    with pytest.raises(FusionError, match=f"reads '{name}' of a traced value"):
        fusion_compiler.compile(model())(torch.randn(1, 3, 8, 8))


class _AsksIfTensors(_Base):
    """Code that asks whether its values are tensors (an optional scale that may be a number,
    a buffer a library may leave unset)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.tensor(0.5))

    def forward(self, x, scale=2.0):
        y = self.conv(x)
        if torch.is_tensor(scale):
            y = y * scale
        if isinstance(self.shift, torch.Tensor) and isinstance(self.conv.weight, nn.Parameter):
            y = y + self.shift
        if isinstance(self.shift, nn.Parameter):  # a buffer: no parameter
            y = y * 0
        return y


def test_isinstance_of_a_traced_tensor_answers_as_eager():
    """fx's proxy is no tensor: ``isinstance(x, torch.Tensor)`` was false in the trace, and the
    other branch was compiled, silently (here the shift was dropped, and a tensor scale)."""
    torch.manual_seed(0)
    model = _AsksIfTensors().eval()
    compiled = fusion_compiler.compile(model)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        for scale in (2.0, torch.tensor(3.0)):
            torch.testing.assert_close(compiled(x, scale), model(x, scale), rtol=1e-5, atol=1e-6)


class _AsksOfItsResults(_Base):
    """Code that asks whether values it computed are tensors (a backbone that may return a
    tensor or a tuple, an item of a chunk, a size that is a number)."""

    def forward(self, x):
        y = self.conv(x)
        if isinstance(y, torch.Tensor):
            y = y * 2
        a, b = torch.relu(y).chunk(2, 1)
        if torch.is_tensor(a) and isinstance(b + 1, torch.Tensor):
            y = y + 1
        if isinstance(x.shape[0] * 2, torch.Tensor) or isinstance(y, (tuple, list)):
            y = y * 100
        return y


def test_isinstance_of_a_tensor_ops_result_answers_as_eager():
    """A convolution's, a chunk's item's, a sum's result is a tensor to the model's
    ``isinstance``, as in eager (fx's proxy answered no: the other branch compiled, silently,
    session 52); a size's product and a tensor asked if it is a tuple still answer no."""
    torch.manual_seed(0)
    model, x = _AsksOfItsResults().eval(), torch.randn(2, 3, 6, 6)
    compiled = fusion_compiler.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


class _AsksOfOtherValues(_Base):
    """Values that are no tensor in eager although a tensor op makes them: the indices of
    ``torch.where(cond)``, a type's name, a slice of a chunk's tuple; and a result asked if it
    is a parameter (helper-52, session 52: each took the tensor branch, or failed the trace)."""

    def forward(self, x):
        y = self.conv(x)
        parts = y.chunk(4, 1)[:2]
        if isinstance(torch.where(y > 0), torch.Tensor) or isinstance(y.type(), torch.Tensor):
            y = y * 0
        if isinstance(y, nn.Parameter):
            y = y * 0
        return parts * 0 if isinstance(parts, torch.Tensor) else torch.cat(parts, 1)


def test_isinstance_of_values_tensor_ops_make_that_are_no_tensors_answers_no():
    torch.manual_seed(0)
    model, x = _AsksOfOtherValues().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(fusion_compiler.compile(model)(x), model(x))


class _ReadsGradModeFromC(_Base):
    def forward(self, x):
        y = self.conv(x)
        return y + 1000 if torch._C.is_grad_enabled() else y


def test_the_grad_mode_read_through_torch_c_gets_a_specialization_per_mode():
    """``torch._C.is_grad_enabled()`` was traced as the trace's mode, on for every call
    (helper-53, session 52)."""
    model, x = _ReadsGradModeFromC().eval(), torch.randn(1, 3, 8, 8)
    compiled = fusion_compiler.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x), model(x))


class _HooksItsFeatures(nn.Module):
    """A gradient-scaling hook on an intermediate value (a common stop-or-scale trick)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        y.register_hook(lambda g: g * 0.5)
        return self.conv2(torch.relu(y)).mean((2, 3))


def test_a_tensor_hook_in_forward_is_refused_by_fx_and_kept_by_dynamo():
    """``compile(model)`` refuses it naming it (fx's own text was "argument of type: <class
    'function'>"); through ``torch.compile`` the hook runs, where the shape propagation had
    failed on it ("cannot register a hook on a tensor that doesn't require gradient", reported
    as inputs the model does not take)."""
    import copy

    torch.manual_seed(0)
    model, x = _HooksItsFeatures(), torch.randn(2, 3, 16, 16)
    with pytest.raises(FusionError, match=r"forward calls register_hook\(\) on a traced value"):
        fusion_compiler.compile(copy.deepcopy(model))(x)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="fusion_compiler")
    grads = []
    for m, fn in ((model, model), (twin, compiled)):
        xx = x.clone().requires_grad_()
        fn(xx).square().sum().backward()
        grads.append((xx.grad, m.conv1.weight.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class _TakesAnImageOrABatch(_Base):
    def forward(self, x):
        if isinstance(x, torch.Tensor) and x.dim() == 3:  # one image: a batch of one
            x = x.unsqueeze(0)
        y = self.conv(x)
        return y * 2 if self.conv.weight.ndim == 4 else y


def test_the_number_of_dimensions_of_an_input_or_a_parameter_is_a_number_in_the_trace():
    """``x.dim()`` of a traced input was a proxy: ``if x.dim() == 3`` failed the trace as
    control flow (and, once ``isinstance`` answered as eager, so did the guard in front of it,
    helper-51). A specialization's inputs have their shapes, so the branch eager takes is
    traced, per input rank."""
    torch.manual_seed(0)
    model = _TakesAnImageOrABatch().eval()
    compiled = fusion_compiler.compile(model)
    with torch.no_grad():
        for x in (torch.randn(3, 8, 8), torch.randn(2, 3, 8, 8), torch.randn(3, 8, 8)):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


class _LeavesGradOff(_Base):
    def forward(self, x):
        torch.set_grad_enabled(False)  # (no with: eager leaves the caller's mode off)
        return self.conv(x)


class _LeavesGradOn(_Base):
    def forward(self, x):
        torch.set_grad_enabled(True)
        return self.conv(x) + 1 if torch.is_grad_enabled() else self.conv(x)


class _FlipsGradMode(_Base):
    def forward(self, x):
        torch.set_grad_enabled(not torch.is_grad_enabled())
        return self.conv(x)


@pytest.mark.parametrize("model", [_LeavesGradOff, _LeavesGradOn], ids=["off", "on"])
@pytest.mark.parametrize("caller", [True, False], ids=["grad", "no_grad"])
def test_a_forward_leaving_the_grad_mode_changed_leaves_it_as_eager(model, caller):
    """Eager leaves the caller's mode as ``forward`` set it; a compiled call restored it, so
    the caller's next lines ran in another mode, silently (session 52). The compiled call
    leaves the mode eager leaves, whatever the caller's; the outputs and their
    ``requires_grad`` are eager's."""
    torch.manual_seed(0)
    eager, x = model(), torch.randn(1, 3, 8, 8)
    compiled = fusion_compiler.compile(copy.deepcopy(eager))
    try:
        for _ in range(2):
            results = []
            for fn in (eager, compiled):
                torch.set_grad_enabled(caller)
                out = fn(x)
                results.append((out, out.requires_grad, torch.is_grad_enabled()))
            (want, *wanted), (got, *gotten) = results
            assert gotten == wanted
            torch.testing.assert_close(got, want)
    finally:
        torch.set_grad_enabled(True)


def test_a_dynamo_graph_leaving_the_grad_mode_changed_is_followed_by_the_call():
    """Dynamo writes a bare ``torch.set_grad_enabled(False)`` as a ``_set_grad_enabled`` call
    in its graph; on the GPU the graph ran in a CUDA graph or Inductor glue, which do not leave
    the mode set, and the caller's next lines ran with gradients (session 53's GPU suite).
    The graph's last mode is the one the compiled call leaves."""
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 4, 3)))
    with gm.graph.inserting_before(next(iter(gm.graph.find_nodes(op="call_module")))):
        gm.graph.call_function(torch._C._set_grad_enabled, (False,))
    gm.recompile()
    x = torch.randn(1, 3, 8, 8)
    assert fusion_compiler.compile(gm).specialize(x).graph_module.meta["grad_mode_left"] is False
    assert torch.is_grad_enabled()
    plain = fusion_compiler.compile(fx.symbolic_trace(nn.Conv2d(3, 4, 3)))
    assert plain.specialize(x).graph_module.meta["grad_mode_left"] is None


def test_a_forward_leaving_a_grad_mode_that_depends_on_the_callers_is_refused():
    with pytest.raises(FusionError, match="leaves the gradient mode changed, to one that "):
        fusion_compiler.compile(_FlipsGradMode())
    assert torch.is_grad_enabled()


class _GradFromTraining(_Base):
    def forward(self, x):
        torch.set_grad_enabled(self.training)  # (an evaluation script's model, bare)
        return self.conv(x).relu()


def test_the_grad_mode_left_follows_the_specialization_traced():
    """What forward leaves depends on its Python state (``self.training``): compiled in eval,
    then trained, the call left gradients off and the user's loss had none (helper-54)."""
    torch.manual_seed(0)
    model, x = _GradFromTraining().eval(), torch.randn(2, 3, 8, 8)
    compiled = fusion_compiler.compile(model)
    try:
        with torch.no_grad():
            compiled(x)
        torch.set_grad_enabled(True)
        model.train()
        out = compiled(x)
        assert torch.is_grad_enabled() and out.requires_grad
        model.eval()
        compiled(x)
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)


class _GradBlockFromTraining(_Base):
    def forward(self, x):
        with torch.set_grad_enabled(self.training):  # (a frozen extractor in eval mode)
            return self.conv(x).relu()


@pytest.mark.parametrize("first", ["train", "eval"])
def test_grad_modes_forward_chooses_from_its_training_flag_are_the_calls(first):
    """What a trace says of grad modes (no op records gradients, a block enables them) held for
    every call, from the trace at ``compile``: compiled in eval mode, a training call got a
    specialization without gradients (on the GPU, captured so: the model would not train);
    compiled in train mode, an eval call's output required gradients, eager's not (session
    52). They are now per combination of training flags."""
    torch.manual_seed(0)
    model, x = getattr(_GradBlockFromTraining(), first)(), torch.randn(2, 3, 8, 8)
    compiled = fusion_compiler.compile(model)
    compiled(x)
    for mode in ("eval", "train", "eval"):
        getattr(model, mode)()
        out, want = compiled(x), model(x)
        assert out.requires_grad == want.requires_grad == (mode == "train"), mode
        assert compiled.last.training == (mode == "train"), mode
        torch.testing.assert_close(out, want)


class _TakesStar(_Base):
    def forward(self, *xs):
        return sum(self.conv(x) for x in xs)


def test_a_forward_taking_star_args_is_refused_naming_them():
    """fx's own text spoke of iterating a proxy; the message names ``*xs`` and the fix (the
    torch.compile door traces it)."""
    with pytest.raises(FusionError, match=r"forward takes \*xs, and fx traces a fixed list"):
        fusion_compiler.compile(_TakesStar())
