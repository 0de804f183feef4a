"""Training specializations replayed as CUDA graphs (``compile(model)``'s default on CUDA): the
same gradients and updates as the same compiled model without graphs, gradient accumulation into
``.grad``, parameter updates and ``requires_grad`` changes seen by later replays, buffers updated
once per call, outputs that survive later calls, and a clear error for a backward whose activations
a later call overwrote. Without graphs the two modules run the same plans (same cache directory),
so tolerances are tight. All tests carry ``@pytest.mark.gpu``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import lowered_on_gpu, rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup

pytestmark = pytest.mark.gpu
TOL = 2e-3


def _pair(model: nn.Module, tmp_path, **options) -> tuple[nn.Module, nn.Module, nn.Module,
                                                           nn.Module]:
    """(graphed model, its compiled module, ungraphed model, its compiled module)."""
    other = copy.deepcopy(model)
    options = {"cache_dir": tmp_path, "autotune": 1, "glue_backend": None, **options}
    return (model, fc.compile(model, **options), other,
            fc.compile(other, cuda_graph=False, **options))


def _net() -> nn.Module:
    return randomize_(se_resnet9_fixup(3), seed=2).cuda().half().train()


def _x(n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, 3, 64, 64, device="cuda", dtype=torch.half, generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean() * 1024


def _on_cudnn(*compiled: nn.Module) -> bool:
    """Whether every region of each compiled module's last specialization runs on a GPU kernel
    (in training, cuDNN's; ``autotune=1``: none is timed against PyTorch's ops). The tests compare
    two compiled modules: both falling back to PyTorch's ops would agree too."""
    return all(c.last.regions and all(lowered_on_gpu(r) for r in c.last.regions)
               for c in compiled)


def _assert_close_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None and q.grad.abs().max() > 0:
            assert rel_err(p.grad.float(), q.grad.float()) < TOL, name


def test_graphed_sgd_steps_match_the_ungraphed_module(tmp_path):
    """Three SGD steps: each replay must read the weights the optimizer just updated (the
    channels_last weight copies are made inside the graph, not cached from the capture)."""
    model, fast, other, slow = _pair(_net(), tmp_path)
    opts = [torch.optim.SGD(m.parameters(), lr=2e-5) for m in (model, other)]
    first = None
    for step in range(3):
        losses = []
        for m, c, opt in zip((model, other), (fast, slow), opts):
            opt.zero_grad(set_to_none=True)
            loss = _loss(c(_x(seed=0)))  # the same batch: the loss moves with the weights
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= TOL * abs(losses[1]), (step, losses)
        first = losses[1] if first is None else first
    # the updates moved the loss far more than the tolerance, so stale weights would show
    assert abs(losses[1] - first) > 10 * TOL * first, (first, losses)
    assert fast.last.cuda_graph == "safe" and slow.last.cuda_graph is None
    assert _on_cudnn(fast, slow), fast.report()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert rel_err(p.float(), q.float()) < TOL, name


def test_the_mixed_precision_step_is_captured_and_matches_the_ungraphed_module(tmp_path):
    """fp32 parameters under ``torch.autocast`` with a ``GradScaler``, the recipe most networks
    train with: the step is replayed from CUDA graphs (in session 37 its capture failed with
    ``cudaErrorStreamCaptureInvalidated`` and it ran without one, host-bound), and three steps
    match the same compiled model without graphs."""
    model, fast, other, slow = _pair(randomize_(se_resnet9_fixup(3), seed=2).cuda().train(),
                                     tmp_path)
    opts = [torch.optim.SGD(m.parameters(), lr=2e-5) for m in (model, other)]
    scalers = [torch.amp.GradScaler("cuda") for _ in range(2)]
    for step in range(3):
        losses = []
        for c, opt, scaler in zip((fast, slow), opts, scalers):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = _loss(c(_x(seed=0).float()))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 3 * TOL * abs(losses[1]), (step, losses)
    assert fast.last.cuda_graph == "safe", fast.last.notes
    assert not any("without a CUDA graph" in n for n in fast.last.notes), fast.last.notes
    assert _on_cudnn(fast, slow), fast.report()


def test_gradients_accumulate_over_micro_batches_and_zero_grad_in_place(tmp_path):
    model, fast, other, slow = _pair(_net(), tmp_path)
    for m, c in ((model, fast), (other, slow)):
        for seed in (1, 2):  # two micro-batches, no zero_grad between them
            _loss(c(_x(seed=seed))).backward()
    _assert_close_grads(model, other)
    kept = {n: p.grad.clone() for n, p in model.named_parameters()}
    for m, c in ((model, fast), (other, slow)):
        m.zero_grad(set_to_none=False)  # zeros the .grad tensors in place
        _loss(c(_x(seed=3))).backward()
    _assert_close_grads(model, other)
    for m in (model, other):  # DDP's buckets need no layout copy (1x1 weights included)
        for name, p in m.named_parameters():
            assert p.grad.stride() == p.stride(), name
    for name, p in model.named_parameters():
        assert not torch.equal(p.grad, kept[name]) or kept[name].abs().max() == 0, name
    assert fast.last.cuda_graph == "safe" and _on_cudnn(fast, slow), fast.report()


def test_returned_gradients_are_not_overwritten_by_the_next_replay(tmp_path):
    model, fast, _, _ = _pair(_net(), tmp_path)
    _loss(fast(_x(seed=1))).backward()
    first = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _loss(fast(_x(seed=2))).backward()
    for name, (grad, copy_) in first.items():
        assert torch.equal(grad, copy_), name


def test_outputs_survive_later_calls(tmp_path):
    _, fast, _, _ = _pair(_net(), tmp_path)
    y1 = fast(_x(seed=1))
    kept = y1.detach().clone()
    fast(_x(seed=2)).sum().backward()
    assert torch.equal(y1.detach(), kept)


def test_backward_after_a_later_forward_names_the_fix(tmp_path):
    _, fast, _, _ = _pair(_net(), tmp_path)
    first = _loss(fast(_x(seed=1)))
    _loss(fast(_x(seed=2)))
    with pytest.raises(RuntimeError, match="cuda_graph=False"):
        first.backward()


def test_requires_grad_changes_are_respected(tmp_path):
    model, fast, other, slow = _pair(_net(), tmp_path)
    for m, c in ((model, fast), (other, slow)):
        _loss(c(_x(seed=1))).backward()
        m.zero_grad(set_to_none=True)
        for p in m.layer1.parameters():
            p.requires_grad_(False)
        _loss(c(_x(seed=2))).backward()
    assert all(p.grad is None for p in model.layer1.parameters())
    _assert_close_grads(model, other)
    assert fast.last.cuda_graph == "safe" and _on_cudnn(fast, slow), fast.report()


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + y)


def test_batch_norm_statistics_see_one_update_per_call_and_eval_switches(tmp_path):
    torch.manual_seed(0)
    model = _ConvBN().cuda().half().train()
    eager = copy.deepcopy(model)
    fast = fc.compile(model, cache_dir=tmp_path, autotune=1, glue_backend=None)
    xs = [torch.randn(8, 8, 16, 16, device="cuda", dtype=torch.half) for _ in range(2)]
    for x in xs:
        fast(x).float().sum().backward()
        eager(x).float().sum().backward()
    assert fast.last.cuda_graph == "safe" and _on_cudnn(fast), fast.report()
    for name, b in model.named_buffers():
        e = dict(eager.named_buffers())[name]
        if b.is_floating_point():
            assert rel_err(b.float(), e.float()) < 1e-2, name
        else:
            assert torch.equal(b, e), name  # num_batches_tracked == 2
    model.eval()
    eager.eval()
    with torch.no_grad():
        fast.specialize(xs[0])  # lowered now (a first call would answer from tier 0)
        assert rel_err(fast(xs[0]).float(), eager(xs[0]).float()) < 1e-2
    assert not fast.last.training and _on_cudnn(fast), fast.report()


def test_a_training_capture_gives_its_backward_plans_an_owner(tmp_path, monkeypatch):
    """The backward of a captured training step runs on autograd's device thread: its cuDNN
    plans must still get the capture's own workspaces (keyed by its owner), not the capture
    stream's shared one, which another runner's graphs use too."""
    import contextlib
    import threading

    import fusion_compiler.runtime.cuda_graph_training as training
    from fusion_compiler.backends.cudnn.backend import CudnnBackend
    from fusion_compiler.runtime.tensors import capture_owner

    seen: list[tuple[str, object]] = []  # (thread, owner) of each workspace asked in a capture
    in_step_capture = threading.Event()  # the step's captures, not autotuning's timing graphs
    workspace, capturing = CudnnBackend.workspace, training.capturing

    def spy(self, device, nbytes):
        if in_step_capture.is_set() and torch.cuda.is_current_stream_capturing():
            seen.append((threading.current_thread().name, capture_owner()))
        return workspace(self, device, nbytes)

    @contextlib.contextmanager
    def step_capture(*args, **kwargs):
        with capturing(*args, **kwargs):
            in_step_capture.set()
            try:
                yield
            finally:
                in_step_capture.clear()

    monkeypatch.setattr(CudnnBackend, "workspace", spy)
    monkeypatch.setattr(training, "capturing", step_capture)
    model = _net()
    fast = fc.compile(model, cache_dir=tmp_path, autotune=1, glue_backend=None)
    for _ in range(3):
        _loss(fast(_x())).backward()
    assert fast.last.cuda_graph == "safe" and _on_cudnn(fast), fast.report()
    assert seen and all(owner is not None for _, owner in seen), seen  # threads named too
    assert len({id(owner) for _, owner in seen}) == 1  # the step's forward and backward
