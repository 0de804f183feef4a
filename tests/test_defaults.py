"""``compile(model)`` with no options: bounded specializations, the shape cache (a warm compile
imports no ``torch._dynamo``), the cuDNN recipes plans are keyed by, the plan-build workers.
CPU tests; the CUDA-graph and cuDNN side of the defaults is in ``test_gpu_defaults.py``."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import rel_err

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.backends.cudnn.graph import region_recipe
from fusion_compiler.backends.cudnn.recipe import any_batch_key, canonical, recipe_key
from fusion_compiler.backends.cudnn.workers import PlanWorkers, build_candidates

ROOT = Path(__file__).resolve().parents[1]


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()).eval()


def test_specializations_are_bounded_least_recently_used_first(caplog):
    model = _small()
    compiled = fc.compile(model, max_specializations=16, cache_dir=False)
    caplog.set_level(logging.INFO, logger="fusion_compiler")

    def batches() -> set[int]:
        return {key[0][0].shape[0] for key in compiled.specializations}

    with torch.no_grad():
        for n in range(1, 41):
            x = torch.randn(n, 8, 6, 6)
            assert rel_err(compiled(x), model(x)) < 1e-5
            if n == 16:
                compiled(torch.randn(1, 8, 6, 6))  # batch 1 is used again: 2 is now the oldest
            if n == 17:
                assert 1 in batches() and 2 not in batches()
    assert len(compiled.specializations) == 16 and batches() == set(range(25, 41))
    assert sum("evicted the specialization" in r.message for r in caplog.records) == 24


def test_specialize_binds_a_calls_arguments_and_runs_no_forward_pass():
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x, scale=1.0, *, shift=None):
            y = torch.relu(self.bn(self.conv(x))) * scale
            return y if shift is None else y + shift

    torch.manual_seed(0)
    model = Gated().train()
    compiled = fc.compile(model, cache_dir=False)
    x, shift = torch.randn(2, 3, 6, 6), torch.randn(2, 8, 6, 6)
    stats = [b.clone() for b in model.buffers()]
    spec = compiled.specialize(x, shift=shift)
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))  # no forward ran
    assert len(compiled.specializations) == 1
    compiled(x, shift=shift)  # the call finds the specialization compiled above
    assert len(compiled.specializations) == 1 and compiled.last is spec
    with pytest.raises(TypeError, match="colour"):  # as the call would raise
        compiled.specialize(x, colour=1)


def test_inference_mode_makes_an_inference_specialization_whatever_the_grad_mode_inside_it():
    model = _small().train()  # parameters requiring grad
    compiled = fc.compile(model, cache_dir=False)
    x = torch.randn(2, 8, 6, 6)
    with torch.inference_mode(), torch.enable_grad():  # autograd records nothing here
        spec = compiled.specialize(x)
        out = compiled(x)
    assert not spec.training and not out.requires_grad
    assert rel_err(out, model(x)) < 1e-5


def test_a_no_grad_call_of_a_forward_with_an_enable_grad_block_is_a_training_one():
    """A ``torch.enable_grad`` block in forward records gradients in a ``no_grad`` call, as in
    eager: the call gets a training specialization, and its training step is never captured in
    a CUDA graph (a replay under ``no_grad`` would record none). On the GPU the inference
    specialization, captured in inference mode, returned an output that required no gradient
    (session 52, GPU conformance ``enable_grad_in_a_no_grad_call``)."""
    from fusion_compiler import graphing
    from fusion_compiler.config import CompileOptions, Target
    from fusion_compiler.glue_compile import glue_backend
    from fusion_compiler.runners import with_formats

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            with torch.enable_grad():
                return self.bn(y)

    torch.manual_seed(0)
    model = Head().train()
    compiled = fc.compile(model, cache_dir=False)
    x = torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        spec = compiled.specialize(x)
        out = compiled(x)
    assert spec.training and out.requires_grad and spec.glue_backend is None
    out.square().mean().backward()
    assert model.bn.weight.grad is not None and model.conv.weight.grad is None
    notes: list[str] = []
    run, how = graphing.graphed(model, model, (), notes, model=model, options=CompileOptions(),
                                note=lambda n, r: n.append(r), training=True, caller_grad=False)
    assert run is model and how is None and "torch.enable_grad" in notes[0], notes
    # the copy into eager's memory format (GPU regions return channels-last outputs) too
    channels_last = with_formats(lambda a: model(a.to(memory_format=torch.channels_last)),
                                 [torch.contiguous_format])
    with torch.no_grad():
        out = channels_last(x)
    assert out.is_contiguous() and out.requires_grad
    target = Target(cuda=True, training=True, grad_enabled=False)  # Inductor's glue records none
    assert glue_backend(CompileOptions(glue_backend="inductor"), compiled.last.graph_module,
                        target)[0] is None


def test_a_forward_reading_the_grad_mode_with_an_enable_grad_block_trains_in_a_no_grad_call():
    """Where forward also reads ``torch.is_grad_enabled()``, the construction-time trace marked
    no block as turning gradients on (its two traces differ), and a ``no_grad`` call got an
    inference specialization: on the GPU one captured without gradients (helper-52, session
    52)."""
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            if torch.is_grad_enabled():
                x = x * 1.0
            with torch.enable_grad():
                y = self.c1(x)
            return y, self.c2(y)

    compiled = fc.compile(Reads().eval(), cache_dir=False)
    with torch.no_grad():
        spec = compiled.specialize(torch.randn(1, 3, 8, 8))
        y, z = compiled(torch.randn(1, 3, 8, 8))
    assert spec.training and y.requires_grad and not z.requires_grad


def test_a_no_grad_block_in_a_forward_reading_the_grad_mode_is_no_enable_grad_block(caplog):
    """A forward that reads the grad mode and has a ``torch.no_grad()`` block (no
    ``enable_grad``) counted as turning gradients on: its ``no_grad`` calls got training
    specializations, and with a custom ``autograd.Function`` ran uncompiled (helper-54)."""
    class Swish(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * torch.sigmoid(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            s = torch.sigmoid(x)
            return g * s * (1 + x * (1 - s))

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            y = Swish.apply(self.c(x))
            if torch.is_grad_enabled():
                y = y + 0.0
            with torch.no_grad():
                scale = y.abs().amax((1, 2, 3), keepdim=True)
            return self.c2(y / scale)

    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(2, 3, 8, 8)
    compiled = fc.compile(model, cache_dir=False)
    with torch.no_grad(), caplog.at_level("WARNING", logger="fusion_compiler"):
        out = compiled(x)
        assert rel_err(out, model(x)) < 1e-5
    assert not compiled.last.training and not caplog.records, caplog.records


def test_inference_mode_and_no_grad_calls_get_their_own_specializations():
    """Inside ``inference_mode`` a call returns inference tensors and under ``no_grad`` normal
    ones, as eager does; each mode has its specialization (a CUDA graph captured in one mode
    returns its mode's tensors; on the H200 a shared graph made Dynamo recompile the graph after
    a break when the tier changed the outputs' kind)."""
    model = _small().eval()
    compiled = fc.compile(model, cache_dir=False)
    x = torch.randn(2, 8, 6, 6)
    with torch.inference_mode():
        first = compiled(x)
    with torch.no_grad():
        second = compiled(x)
        second.add_(1.0)  # a normal tensor takes in-place writes outside inference mode
        want = model(x) + 1.0
    assert first.is_inference() and not second.is_inference()
    assert len(compiled.specializations) == 2
    assert rel_err(second, want) < 1e-5


def test_a_forward_decorated_with_inference_mode_has_one_specialization_in_and_out_of_it():
    """A forward decorated with ``@torch.inference_mode()`` runs inside inference mode whether
    or not the caller is: one specialization serves both, and its outputs are inference
    tensors, as eager's are."""
    class Decorated(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        @torch.inference_mode()
        def forward(self, x):
            return torch.relu(self.conv(x))

    model = Decorated().eval()
    compiled = fc.compile(model, cache_dir=False)
    x = torch.randn(2, 8, 6, 6)
    outside = compiled(x)
    with torch.inference_mode():
        inside = compiled(x)
    assert outside.is_inference() and inside.is_inference()
    assert len(compiled.specializations) == 1
    assert rel_err(outside, model(x)) < 1e-5


def test_invalid_options_are_value_errors():
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        fc.compile(_small(), cuda_graph="always")
    with pytest.raises(ValueError, match="max_specializations must be at least 1"):
        fc.compile(_small(), max_specializations=0)


def test_defaults_on_the_cpu_take_no_cuda_graph_and_no_glue_backend():
    compiled = fc.compile(_small(), cache_dir=False)
    with torch.no_grad():
        compiled(torch.randn(2, 8, 6, 6))
    assert compiled.last.cuda_graph is None and compiled.last.glue_backend is None


_WARM = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import fusion_compiler as fc
    import fusion_compiler.passes.manager as manager
    from examples.seresnet9_fixup import se_resnet9_fixup, randomize_
    manager.REAL_PROPAGATION_BUDGET_S = 30.0  # a loaded machine must not take the meta path
    model = randomize_(se_resnet9_fixup(3)).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        err = (fc.compile(model, cache_dir={cache!r})(x) - model(x)).abs().max().item()
    print(err, "torch._dynamo" in sys.modules, "sympy" in sys.modules)
""")


def test_cold_and_warm_compiles_import_no_dynamo(tmp_path):
    """The first compile of a small model propagates shapes by running the graph on the inputs
    (no meta kernel, which would import sympy and torch._dynamo) and caches them; a new process
    compiling the same model for the same inputs reads them and runs nothing. (The budget after
    which propagation turns to meta kernels is raised here: on a loaded CI machine it ran out
    once, 2026-11-27.)"""
    script = _WARM.format(root=str(ROOT), cache=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=300, cwd=ROOT) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
        (err, dynamo, sympy) = run.stdout.split()
        assert float(err) < 1e-4
        assert (dynamo, sympy) == ("False", "False")
    assert list(tmp_path.glob("*.shapes.json"))


class _SideEffects(nn.Module):
    """Batch norm in training mode (updates its running statistics), dropout (draws random
    numbers) and an in-place ReLU on the input."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        x = x.relu_()
        return torch.nn.functional.dropout(self.bn(self.conv(x)), 0.5, training=True)


def test_propagation_on_the_inputs_leaves_no_trace_and_matches_meta_propagation():
    from fusion_compiler.capture import capture
    from fusion_compiler.shapes import propagate_shapes

    model = _SideEffects().train()
    x = torch.randn(2, 4, 8, 8)
    before = (x.clone(), [b.clone() for b in model.buffers()], torch.get_rng_state())
    real = propagate_shapes(capture(model), [x], real=True)
    assert torch.equal(x, before[0])
    assert all(torch.equal(b, s) for b, s in zip(model.buffers(), before[1]))
    assert torch.equal(torch.get_rng_state(), before[2])
    meta = propagate_shapes(capture(model), [x])
    for a, b in zip(real.graph.nodes, meta.graph.nodes):
        va, vb = a.meta["val"], b.meta["val"]
        if isinstance(vb, torch.Tensor):
            assert va.device.type == "meta" and a.meta["device"] == b.meta["device"], a.name
            assert (va.shape, va.stride(), va.dtype) == (vb.shape, vb.stride(), vb.dtype), a.name


def test_slow_propagation_on_the_inputs_falls_back_to_meta(monkeypatch):
    """After a run over REAL_PROPAGATION_BUDGET_S the later stages use meta tensors."""
    from fusion_compiler import shapes
    from fusion_compiler.passes import manager

    calls = []
    real_run = shapes._MetaPropagation.run
    monkeypatch.setattr(shapes._MetaPropagation, "run",
                        lambda self, *a: calls.append(1) or real_run(self, *a))
    monkeypatch.setattr(manager, "REAL_PROPAGATION_BUDGET_S", 0.0)
    with torch.no_grad():
        fc.compile(_small(), cache_dir=False)(torch.randn(2, 8, 6, 6))
    # every stage after "captured" (which is run on the inputs) that changed the graph:
    # normalize and fuse (fold_bn finds no batch norm, verify changes nothing)
    assert len(calls) == 2


def test_a_pass_that_changes_no_graph_is_not_propagated_again(monkeypatch):
    from fusion_compiler.capture import capture
    from fusion_compiler.config import CompileOptions, Target
    from fusion_compiler.passes import Pass, PassManager, fusion, manager, pre_fusion

    calls = []
    real_propagate = manager.propagate_shapes
    monkeypatch.setattr(manager, "propagate_shapes",
                        lambda *a, **k: calls.append(1) or real_propagate(*a, **k))
    options, target = CompileOptions(), Target(cuda=False)
    passes = [*pre_fusion(options, target), *fusion(options, target)]
    noop = Pass("noop", lambda gm: gm)
    run = PassManager([passes[0], noop, *passes[1:]], [torch.randn(2, 8, 6, 6)])
    with torch.no_grad():
        gm = run.run(capture(_small()))
    assert len(calls) == 3  # captured, normalize, fuse
    assert run.recorded["noop"] == run.recorded["normalize"]
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")


def test_the_shape_cache_is_keyed_by_module_configuration(tmp_path):
    """Two models with the same traced code and parameter shapes but another conv stride must not
    share cached shapes (the stride lives in the module, not in the code)."""
    x = torch.randn(2, 8, 8, 8)
    for stride in (1, 2):
        model = nn.Sequential(nn.Conv2d(8, 8, 3, stride=stride, padding=1), nn.ReLU()).eval()
        with torch.no_grad():
            out = fc.compile(model, cache_dir=tmp_path)(x)
            assert out.shape == model(x).shape and rel_err(out, model(x)) < 1e-5


def test_the_shape_cache_is_keyed_by_the_packages_sources(tmp_path, monkeypatch):
    """Shape tables recorded by other code (a pass changed, the version number not) are not
    applied: their node names can match another graph's (a stale table gave a weight an
    activation's shape)."""
    import fusion_compiler.specialization as specialization
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        fc.compile(model, cache_dir=tmp_path)(x)
        recorded = set(tmp_path.glob("*.shapes.json"))
        fc.compile(model, cache_dir=tmp_path)(x)  # the same code: the same table
        assert set(tmp_path.glob("*.shapes.json")) == recorded
        monkeypatch.setattr(specialization, "source_digest", lambda: "other sources")
        out = fc.compile(model, cache_dir=tmp_path)(x)
    assert len(set(tmp_path.glob("*.shapes.json")) - recorded) == 1
    assert rel_err(out, model(x)) < 1e-5


def test_recipes_name_tensors_by_position_and_abstract_the_batch():
    model = randomize_(se_resnet9_fixup(3)).eval()
    recipes = {}
    for n in (2, 4):
        with torch.no_grad():
            spec = fc.compile(model, cache_dir=False).specialize(torch.randn(n, 3, 64, 64))
        recipes[n] = [region_recipe(r) for r in spec.regions]
    for a, b in zip(recipes[2], recipes[4]):
        assert recipe_key(a) != recipe_key(b)  # another batch: another plan
        assert any_batch_key(a) == any_batch_key(b)  # but the same choice of engine
    names = [t["name"] for t in canonical(recipes[2][1])["inputs"]]
    assert names == [f"t{i}" for i in range(len(names))]


def test_plan_build_jobs_report_errors_instead_of_raising():
    """Without a GPU the cuDNN handle cannot be made: the job answers with the reason."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    result = build_candidates({"recipe": {"io": "HALF", "inputs": [], "ops": [], "outputs": []},
                               "mode": "first", "heuristics": ["A"]})
    assert set(result) == {"error"} and result["error"]


def test_dead_plan_workers_fail_their_jobs_instead_of_hanging():
    workers = PlanWorkers("GPU-none", 2, command=[sys.executable, "-c", "import sys; sys.exit(1)"])
    try:
        futures = [workers.submit({"mode": "first"}) for _ in range(5)]
        for future in futures:
            with pytest.raises(EOFError):
                future.result(timeout=60)
    finally:
        workers.close()
    with pytest.raises(EOFError):  # a pool closed (idle) after a caller took it
        workers.submit({"mode": "first"}).result(timeout=1)


def test_plan_workers_that_cannot_start_are_tried_once_and_said_once(monkeypatch, caplog):
    """Starting the worker processes spawns processes: where that fails it is not tried at every
    compile, and the plans building in this process instead is one WARNING, not a silent note."""
    from fusion_compiler.backends.cudnn import backend, workers
    from fusion_compiler.runtime import background

    starts = []

    def no_processes(gpu_uuid, size, command=None):
        starts.append(gpu_uuid)
        raise OSError("[Errno 11] Resource temporarily unavailable")

    monkeypatch.setattr(workers, "PlanWorkers", no_processes)
    monkeypatch.setattr(workers, "_START_FAILED", {})
    monkeypatch.setattr(background, "_warned", set())
    monkeypatch.setenv(workers.ENV_VAR, "2")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), {"uuid": "test-gpu"})())
    caplog.set_level(logging.INFO, logger="fusion_compiler")
    for _ in range(3):
        assert backend.CudnnBackend._pool(torch.device("cuda", 0)) is None
    assert starts == ["GPU-test-gpu"]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "Resource temporarily unavailable" in warned[0].getMessage()
    assert "plans build in this process" in warned[0].getMessage()

def test_plan_workers_that_all_exit_at_start_are_not_started_again(monkeypatch):
    """Workers that start but exit before answering (no cuDNN handle: a GPU in exclusive
    mode) fail their jobs, and the GPU gets no new pool in this process."""
    from fusion_compiler.backends.cudnn import workers

    real, pools = workers.PlanWorkers, []

    def exiting(gpu_uuid, size, command=None):
        exits = [sys.executable, "-c", "import sys; sys.exit(3)"]
        pools.append(real(gpu_uuid, size, command=exits))
        return pools[-1]

    monkeypatch.setattr(workers, "PlanWorkers", exiting)
    monkeypatch.setattr(workers, "_START_FAILED", {})
    monkeypatch.setattr(workers, "_POOLS", {})
    monkeypatch.setenv(workers.ENV_VAR, "2")
    pool = workers.workers_for("GPU-exiting")
    try:
        with pytest.raises(EOFError):
            pool.submit({"mode": "first"}).result(timeout=60)
        for proc in pool.procs:  # (the other worker has exited too, or is about to)
            proc.wait(timeout=60)
        for _ in range(2):
            with pytest.raises(OSError, match="exited before answering"):
                workers.workers_for("GPU-exiting")
        assert len(pools) == 1
    finally:
        pool.close()

def test_weight_copies_are_made_at_every_call_outside_a_derivation_scope():
    """A kernel's weight copy is never remembered across calls outside a scope: writes that no
    version counter records (``p.data``, a fused optimizer) must not leave it stale. Within one
    epoch (a capture: the forward and backward of a training step share it) it is made once per
    weight; a new epoch makes it again."""
    from fusion_compiler.runtime.weight_cache import WeightCache, derivation_epoch

    made = []
    cache = WeightCache(convert=lambda t: made.append(1) or t.clone())
    w = torch.randn(8, 4, 3, 3)
    assert torch.equal(cache(w), w) and len(made) == 1
    w.data.mul_(2)  # no version change
    assert torch.equal(cache(w), w) and len(made) == 2
    with derivation_epoch():
        first = cache(w)
        assert cache(w) is first
    assert len(made) == 3
    with derivation_epoch():
        cache(w), cache(w.clone())  # another tensor: made for it too
    assert len(made) == 5


def test_graphed_training_differentiates_through_aliases_that_run_no_parameter_hooks():
    """Warm-up and capture of a graphed training step take gradients with respect to aliases of
    the parameters (``TrainingGraphRunner._aliases``, read through ``functional_call``): the same
    storage and the same gradients, but hooks on the parameters themselves (DDP's) do not run.
    The CUDA-graph part needs a GPU (``test_gpu_graphed_training.py``); this runs the alias part
    on the CPU without capturing."""
    from fusion_compiler.runtime.cuda_graph_training import TrainingGraphRunner

    model = _small().train()
    x = torch.randn(2, 8, 6, 6)
    runner = TrainingGraphRunner.__new__(TrainingGraphRunner)  # no capture: CPU only
    # as in compile(): fn is a function that calls the module
    runner.fn, runner.module, runner.static_inputs = (lambda t: model(t)), model, [x]
    runner.all_parameters = list(model.parameters())
    runner.parameters = [p for p in runner.all_parameters if p.requires_grad]
    fired = []
    for p in model.parameters():
        p.register_hook(lambda g: fired.append(1))
    named, aliases = runner._aliases()
    assert set(named) == {n for n, _ in model.named_parameters()}
    assert [a.data_ptr() for a in aliases] == [p.data_ptr() for p in runner.parameters]
    got = torch.autograd.grad(runner._run(named).square().sum(), aliases)
    assert not fired
    want = torch.autograd.grad(model(x).square().sum(), runner.parameters)
    assert len(fired) == len(want)  # the hooks do run when the parameters themselves are used
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("inference", [True, False])
@pytest.mark.parametrize("caller_inside", [True, False])
def test_graph_runners_capture_in_their_specializations_mode(inference, caller_inside):
    """A CUDA-graph runner captures in the inference mode of the specialization it serves,
    gradients off, whatever the mode of the call that builds it or switches tiers (a wait
    outside inference mode for an inference specialization, or the reverse), and makes its
    buffers as normal tensors."""
    from types import SimpleNamespace

    from fusion_compiler.runtime.cuda_graph import CudaGraphRunner
    runner = SimpleNamespace(inference=inference, buffers=[torch.zeros(2)])
    with torch.inference_mode(caller_inside), torch.enable_grad():
        with CudaGraphRunner._capturing_mode(runner):
            assert torch.is_inference_mode_enabled() == inference
            assert not torch.is_grad_enabled()
            assert torch.ones(1).is_inference() == inference
        with CudaGraphRunner._making(runner):
            assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
            assert not torch.ones(1).is_inference()


def test_graph_buffers_made_inside_inference_mode_are_normal_tensors_without_grad():
    """What a CUDA-graph runner keeps (made under ``_normal_tensors``) takes in-place writes in
    and outside ``inference_mode``, records no autograd history under ``enable_grad`` inside it,
    and stays in inference mode where the state it writes holds inference tensors."""
    from fusion_compiler.runtime.cuda_graph import _normal_tensors

    weight = torch.randn(3, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        x = torch.randn(3)
        with _normal_tensors():
            kept = x.clone()
            product = kept * weight
            assert not torch.is_inference_mode_enabled()
        inference_state = torch.zeros(3)
        with _normal_tensors([inference_state]):
            assert torch.is_inference_mode_enabled()
            inference_state.add_(1)
        kept.copy_(x)  # a later call inside inference mode
    assert not kept.is_inference() and not product.requires_grad
    with torch.no_grad():
        kept.copy_(torch.ones(3))  # and one outside it


def test_restored_gives_buffers_back_their_values():
    from fusion_compiler.runtime.tensors import restored

    bn = nn.BatchNorm2d(4).train()
    before = [b.clone() for b in bn.buffers()]
    with restored(list(bn.buffers())):
        bn(torch.randn(2, 4, 3, 3))
        assert not torch.equal(bn.running_mean, before[0])
    assert all(torch.equal(b, s) for b, s in zip(bn.buffers(), before))


@pytest.mark.parametrize("work", ["load", "build", "tune"])
def test_a_call_answers_from_the_regions_ops_until_the_graph_is_lowered(monkeypatch, work):
    """Tier 0 (``CompiledModule._tier_before_lowering``): the first calls of a specialization a
    call compiled run the regions' own PyTorch ops while the background thread lowers the graph;
    the first call after that runs the lowered graph, and ``specialize`` waits for it. On the
    CPU the condition (CUDA inference in a CUDA graph; every plan cached, plans to build, or to
    build and time at the switch) is forced; the GPU tests are in test_gpu_defaults.py."""
    import threading

    from fusion_compiler.runtime.background import submit
    from fusion_compiler.runtime.tiered import TieredRunner
    from fusion_compiler.specialization import SpecializationCompiler

    model = randomize_(se_resnet9_fixup(3), seed=2).eval()
    compiled = fc.compile(model, cache_dir=False)
    monkeypatch.setattr(SpecializationCompiler, "_work_before_lowering", lambda self, *a: work)
    gate = threading.Event()
    submit(lambda: gate.wait(30))  # the background thread is busy: the build waits its turn
    x = torch.randn(3, 3, 64, 64)
    with torch.inference_mode():
        want = model(x)
        out = compiled(x)
        spec = compiled.last
        assert isinstance(spec.run, TieredRunner) and spec.run.pending
        assert {r.status for r in spec.regions} == {"fused"} and not spec.lowered
        assert rel_err(out, want) < 1e-5
        gate.set()
        assert compiled.wait_for_background_compiles(60)
        assert "fused" not in {r.status for r in spec.regions} and not spec.run.pending
        assert spec.run.tier == 2 and spec.lowered and rel_err(compiled(x), want) < 1e-5
        y = torch.randn(5, 3, 64, 64)
        gate.clear()
        submit(lambda: gate.wait(30))
        compiled(y)
        assert not compiled.last.lowered
        threading.Timer(0.3, gate.set).start()
        spec = compiled.specialize(y)  # waits for the lowering the call left to the thread
        assert spec is compiled.last and spec.lowered
        assert "fused" not in {r.status for r in spec.regions}


def test_a_warm_start_answers_from_tier_0_too(monkeypatch):
    """With every plan cached (``plan_work`` says ``""``) a call's specialization still answers
    from tier 0 while the background thread loads the plans: loading and the CUDA graph capture
    would otherwise come before the first output. Without tier 0 it lowers at once."""
    import fusion_compiler.specialization as specialization
    from fusion_compiler.config import CompileOptions, Target

    monkeypatch.setattr(specialization, "plan_work", lambda gm, options: "")
    compiler = specialization.SpecializationCompiler(nn.Conv2d(3, 8, 3), CompileOptions(),
                                                     lambda notes, reason: None)
    target = Target(cuda=True)
    monkeypatch.setattr(CompileOptions, "tiers_before_lowering", lambda self, t: True)
    assert compiler._work_before_lowering(None, target) == "load"
    monkeypatch.setattr(CompileOptions, "tiers_before_lowering", lambda self, t: False)
    assert compiler._work_before_lowering(None, target) == ""


def test_gpu_timing_is_refused_inside_timing_deferred():
    from fusion_compiler.backends.timing import (ensure_timing_allowed, paired_time_ms,
                                                 timing_deferred)
    from fusion_compiler.ir.errors import TimingDeferred

    ensure_timing_allowed()
    with timing_deferred():
        with pytest.raises(TimingDeferred):
            paired_time_ms([lambda: None])  # refused before anything touches the GPU
        with timing_deferred():
            pass
        with pytest.raises(TimingDeferred):  # still refused after a nested block
            ensure_timing_allowed()
    ensure_timing_allowed()


def test_a_background_lowering_that_needs_timing_is_redone_at_the_switch(monkeypatch):
    """Tier 0's background lowering may find it must time after all (a reused choice cuDNN
    rejects is tuned anew): it raises ``TimingDeferred`` there, and the switch lowers again on
    the calling thread, where timing may run."""
    import threading

    from fusion_compiler.backends.timing import ensure_timing_allowed
    from fusion_compiler.specialization import SpecializationCompiler

    lowered_on = []
    lower = SpecializationCompiler._lower

    def needs_timing_once(self, *args, **kwargs):
        lowered_on.append(threading.current_thread() is threading.main_thread())
        if len(lowered_on) == 1:
            ensure_timing_allowed()  # raises in the background (timing deferred there)
        return lower(self, *args, **kwargs)

    monkeypatch.setattr(SpecializationCompiler, "_lower", needs_timing_once)
    monkeypatch.setattr(SpecializationCompiler, "_work_before_lowering",
                        lambda self, *a: "build")
    model = randomize_(se_resnet9_fixup(3), seed=3).eval()
    compiled = fc.compile(model, cache_dir=False)
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        want = model(x)
        assert rel_err(compiled(x), want) < 1e-5  # tier 0
        assert compiled.wait_for_background_compiles(60)
        spec = compiled.last
        assert lowered_on == [False, True] and spec.lowered and spec.notes == []
        assert rel_err(compiled(x), want) < 1e-5


def test_a_compiled_module_is_freed_without_the_garbage_collector():
    """No reference cycle keeps a compiled module (and the model, its plans and buffers) alive
    once its last reference goes: freed when dropped, not at a later collection."""
    import gc
    import weakref

    model = randomize_(se_resnet9_fixup(3), seed=4).train()
    compiled = fc.compile(model, cache_dir=False)
    x = torch.randn(2, 3, 64, 64)
    compiled(x).sum().backward()
    with torch.no_grad():
        compiled(x)
    gc.collect()  # what tracing left (torch.fx's frames), not the module
    gc.disable()
    try:
        gone = weakref.ref(compiled)
        del compiled
        assert gone() is None
    finally:
        gc.enable()


def test_calls_compiles_and_tier_switches_run_on_the_models_device(monkeypatch):
    """``runtime.tensors.on_device_of``: the device of the model's parameters (else of the first
    tensor input) made current when it is a CUDA device other than the current one; every call,
    ``specialize`` and ``wait_for_background_compiles`` enter it with the model's parameter."""
    import contextlib

    import fusion_compiler.compiler as compiler
    from fusion_compiler.runtime import tensors

    class OnCuda1:  # what on_device_of reads of a tensor
        is_cuda = True

        @staticmethod
        def get_device() -> int:
            return 1

    entered = []
    monkeypatch.setattr(tensors.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tensors.torch.cuda, "device", lambda i: entered.append(i) or
                        contextlib.nullcontext())
    tensors.on_device_of(OnCuda1())
    tensors.on_device_of(None, [torch.zeros(1)])  # a CPU input: nothing
    tensors.on_device_of(None, [])
    assert entered == [1]
    monkeypatch.setattr(tensors.torch.cuda, "current_device", lambda: 1)
    tensors.on_device_of(OnCuda1())  # current already
    assert entered == [1]

    refs = []
    monkeypatch.setattr(compiler, "on_device_of", lambda ref, args=(): refs.append(ref) or
                        contextlib.nullcontext())
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).eval()
    compiled = fc.compile(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        compiled(x)
        compiled.specialize(x)
    compiled.wait_for_background_compiles()
    assert len(refs) == 3 and all(r is model[0].weight for r in refs)
