"""The tiered runner (first tier until the background compile is done) and the regions' dry run,
on the CPU: the mechanism without CUDA (tests/test_gpu_defaults.py runs it on the GPU)."""

import shutil
import threading

import pytest
import torch

from fusion_compiler.runtime import region_op
from fusion_compiler.runtime.background import drain, submit
from fusion_compiler.runtime.tiered import TieredRunner
from conftest import relowered


class _Tier:
    def __init__(self, name):
        self.name, self.closed = name, False

    def __call__(self, x):
        return (self.name, x)

    def close(self):
        self.closed = True


def test_calls_stay_on_the_first_tier_until_the_build_ends_then_switch_and_close_it():
    gate = threading.Event()
    first, second = _Tier("first"), _Tier("second")
    built = []

    def build():
        gate.wait(10)
        return "artifact"

    def finish(artifact):
        built.append((artifact, threading.current_thread() is threading.main_thread()))
        return second

    runner = TieredRunner(first, build, finish, on_failure=lambda why: None)
    assert runner(1) == ("first", 1) and runner.tier == 1 and runner.pending  # build submitted
    assert runner.wait(0.05) is False  # still compiling
    gate.set()
    assert runner.wait(10) is True
    assert built == [("artifact", True)]  # finish runs on the calling thread
    assert runner(2) == ("second", 2) and runner.tier == 2 and not runner.pending
    assert first.closed and not second.closed
    runner.close()
    assert second.closed


def test_no_switch_inside_the_callers_cuda_graph_capture(monkeypatch):
    """The switch captures a graph of its own, which cannot happen inside the caller's capture:
    calls made there stay on the first tier (it is captured into the caller's graph) and the
    first call after the capture switches."""
    import fusion_compiler.runtime.tiered as tiered

    capturing = [True]
    monkeypatch.setattr(tiered, "stream_capturing", lambda: capturing[0])
    runner = TieredRunner(_Tier("first"), build=None, finish=lambda a: _Tier("second"),
                          on_failure=lambda why: None)
    assert runner(1) == ("first", 1)
    assert runner(2) == ("first", 2) and runner.tier == 1  # ready, but inside a capture
    capturing[0] = False
    assert runner(3) == ("second", 3) and runner.tier == 2


def test_a_tier_is_not_switched_away_and_closed_under_another_threads_call():
    """Two threads call one model: the one that finds the build done waits for the other's call
    on the first tier to end before it closes that tier (a closed CUDA-graph tier has freed its
    graphs), and switches once."""
    inside, leave = threading.Event(), threading.Event()

    class _Slow(_Tier):
        def __call__(self, x):
            if x == "slow":
                inside.set()
                leave.wait(10)
            assert not self.closed, "called after it was closed"
            return (self.name, x)

    first, made, built = _Slow("first"), [], threading.Event()
    runner = TieredRunner(first, build=lambda: built.wait(10),
                          finish=lambda a: made.append(1) or _Tier("second"),
                          on_failure=lambda why: None)
    runner(0)  # the build starts
    other = threading.Thread(target=runner, args=("slow",))
    other.start()
    inside.wait(10)  # the other thread's call is on the first tier
    built.set()
    assert drain(10)  # the build is done: the next call switches
    out = []
    caller = threading.Thread(target=lambda: out.append(runner(1)))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and not first.closed  # waits for the call on the first tier
    leave.set()
    other.join(10)
    caller.join(10)
    assert out == [("second", 1)] and first.closed and made == [1]


def test_wait_follows_a_second_tier_that_is_tiered_itself():
    """Tier 0 (regions as PyTorch ops) switches to a runner that is itself tiered (Inductor's
    glue): ``wait`` and ``pending`` cover both switches."""
    gate = threading.Event()
    inner = TieredRunner(_Tier("graph"), build=lambda: gate.wait(10),
                         finish=lambda a: _Tier("inductor"), on_failure=lambda why: None)
    outer = TieredRunner(_Tier("ops"), build=lambda: "plans", finish=lambda a: inner,
                         on_failure=lambda why: None)
    assert outer(1) == ("ops", 1) and outer.pending
    assert outer.wait(0.2) is False  # the outer switch happened; the inner build is waiting
    assert outer.run is inner and outer.pending and outer(2) == ("graph", 2)
    gate.set()
    assert outer.wait(10) is True and not outer.pending
    assert outer(3) == ("inductor", 3)


def test_a_failed_build_keeps_the_first_tier_and_reports_why():
    reasons = []

    def build():
        raise ValueError("no Triton\nhere")

    first = _Tier("first")
    runner = TieredRunner(first, build, finish=lambda a: _Tier("second"),
                          on_failure=reasons.append)
    assert runner.wait(10)
    assert runner(3) == ("first", 3) and runner.tier == 1 and not first.closed
    assert reasons == ["ValueError: no Triton here"]


def test_closing_while_the_build_runs_drops_its_result():
    gate, finished = threading.Event(), []
    first = _Tier("first")
    runner = TieredRunner(first, build=lambda: gate.wait(10),
                          finish=lambda a: finished.append(a) or _Tier("second"),
                          on_failure=finished.append)
    assert runner(0) == ("first", 0)  # the first call submits the build
    runner.close()
    gate.set()
    submit(lambda: None).result(10)  # the worker has moved past the dropped job
    assert first.closed and finished == [] and not runner.pending


def test_background_jobs_run_one_at_a_time_in_order():
    order, lock = [], threading.Lock()

    def job(i):
        def run():
            with lock:
                order.append(i)
            return i
        return run

    futures = [submit(job(i)) for i in range(5)]
    assert [f.result(10) for f in futures] == list(range(5)) and order == list(range(5))


def test_dry_run_returns_outputs_of_the_registered_shapes_without_running_the_kernel():
    calls = []

    class Kernel:
        def __call__(self, x):
            calls.append(x)
            return (x * 2,)

    kernel = Kernel()
    key = region_op.register_kernel(kernel, [((2, 3), (3, 1), torch.float32)])
    x = torch.randn(2, 3)
    with region_op.dry_run():
        (out,) = region_op.run_region(key, [x])
    assert calls == [] and out.shape == (2, 3) and out.stride() == (3, 1)
    (out,) = region_op.run_region(key, [x])  # outside, the kernel runs again
    assert len(calls) == 1 and torch.equal(out, x * 2)


def test_a_runner_dropped_before_its_turn_builds_nothing_and_drain_waits_for_the_queue():
    gate, built = threading.Event(), []
    blocker = submit(lambda: gate.wait(10))  # keeps the worker busy
    runner = TieredRunner(_Tier("first"), build=lambda: built.append(1),
                          finish=lambda a: _Tier("second"), on_failure=built.append)
    del runner
    assert drain(0.05) is False
    gate.set()
    assert drain(10) is True and blocker.done() and built == []


def test_the_isolated_copy_shares_tensors_but_no_module_with_the_model():
    import fusion_compiler as fc
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.ir.region import Region
    from fusion_compiler.runtime.tiered import isolated_copy

    model = randomize_(se_resnet9_fixup(3)).eval()
    x = torch.randn(2, 3, 64, 64)
    compiled = fc.compile(model, cache_dir=False, glue_backend=None)
    with torch.inference_mode():
        want = compiled(x)
    gm = compiled.last.graph_module
    copy = isolated_copy(gm, opaque=lambda m: isinstance(m, Region))
    with torch.inference_mode():
        assert torch.equal(copy(x), want)
    ours = {id(m) for m in model.modules()} | {id(m) for m in gm.modules()}
    assert not any(id(m) in ours for m in copy.modules())
    params = {id(p) for p in model.parameters()}
    assert params >= {id(p) for p in copy.parameters()} and len(list(copy.parameters())) > 0
    linear = next(m for m in copy.modules() if isinstance(m, torch.nn.Linear))
    original = linear.weight
    linear.weight = torch.nn.Parameter(torch.zeros_like(original))  # what a trace's swap does
    assert any(p is original for p in model.parameters())
    assert not any(p is linear.weight for p in model.parameters())


def test_a_compile_waits_for_a_background_compile_whose_trace_sets_fx_globals():
    """AOTAutograd's trace on the background thread turns on ``torch.fx.traceback``'s
    process-wide node-metadata copying; a fuse pass beside it failed ("replace_with already has
    .meta keys"). The job here does what that trace does, holding COMPILE_LOCK as a background
    compile does: the compile on this thread waits for it and succeeds."""
    from torch.fx import traceback as fx_traceback

    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.runtime.background import COMPILE_LOCK
    from conftest import patterns, specialize

    inside, release = threading.Event(), threading.Event()

    def trace_like():
        with COMPILE_LOCK, fx_traceback.preserve_node_meta():
            fx_traceback.current_meta["nn_module_stack"] = {"bg": ("bg", torch.nn.Module)}
            inside.set()
            release.wait(10)

    job = submit(trace_like)
    assert inside.wait(10)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    spec = specialize(randomize_(se_resnet9_fixup(3)).eval(), torch.randn(2, 3, 64, 64))
    assert job.done() and len(patterns(spec)) == 9  # 12 convolutions, 6 merged in pairs
    assert not any("nn_module_stack" in n.meta and "bg" in n.meta["nn_module_stack"]
                   for n in spec.graph_module.graph.nodes)


def test_the_first_call_of_inductor_glue_runs_without_the_custom_op_aliasing_check(monkeypatch):
    """Inductor's Triton kernels autotune in the first call of a compiled graph; under
    AOTAutograd's custom-op aliasing check (a Python dispatch mode) the host was too slow for its
    timings to mean anything (``glue_compile.without_custom_op_alias_check``). The check runs at the
    next first call instead. Inductor on the CPU stands in for CUDA: the check is AOTAutograd's."""
    from torch._functorch._aot_autograd import runtime_wrappers

    from fusion_compiler.glue_compile import inductor_compile, without_custom_op_alias_check

    if not hasattr(runtime_wrappers, "_check_custom_op_aliasing"):
        pytest.skip("this torch has no custom-op aliasing check")
    checked = []
    check = runtime_wrappers._check_custom_op_aliasing
    monkeypatch.setattr(runtime_wrappers, "_check_custom_op_aliasing",
                        lambda name, *a: (checked.append(name), check(name, *a))[1])

    class Glue(torch.nn.Module):
        def forward(self, x):
            return torch.ops.fc_test.twice(x.sin()).cos()

    x = torch.randn(4, 8) + 1.0
    with torch.no_grad():
        compiled = inductor_compile(torch.fx.symbolic_trace(Glue()), [x])
        with without_custom_op_alias_check():
            out = compiled(x)
        assert checked == []
        torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out,
                                   (2 * x.sin()).cos())
        compiled(x)
    assert checked == ["fc_test::twice"]


@torch.library.custom_op("fc_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_the_unlowered_copy_runs_each_regions_ops_and_ignores_later_edits_of_the_regions():
    """Tier 0 of a new batch size: a copy whose regions run their own PyTorch ops, unaffected by
    lowering and layout edits made to the original graph's regions meanwhile."""
    import fusion_compiler as fc
    from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
    from fusion_compiler.ir.region import called_region
    from fusion_compiler.runtime.tiered import unlowered_copy

    model = randomize_(se_resnet9_fixup(3)).eval()
    x = torch.randn(2, 3, 64, 64)
    compiled = fc.compile(model, cache_dir=False, glue_backend=None)
    with torch.inference_mode():
        want = model(x)
    gm = compiled.specialize(x).graph_module
    copy = unlowered_copy(gm)
    regions = [r for n in gm.graph.nodes if (r := called_region(gm, n)) is not None]
    for region in regions:  # what lowering and the layout edits could do to the originals
        relowered(region, kernel=lambda *a: (_ for _ in ()).throw(
            AssertionError("lowered kernel ran")))
        for node in list(region.graph_module.graph.nodes):
            if node.op == "output":
                node.args = (tuple(torch.zeros(1) for _ in region.output_nodes),)
        region.graph_module.recompile()
    with torch.inference_mode():
        torch.testing.assert_close(copy(x), want, rtol=1e-4, atol=1e-4)
    assert not any(called_region(copy, n) is not None for n in copy.graph.nodes)


_AOT_CACHE_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {root!r})
import fusion_compiler as fc
from examples.seresnet9_fixup import randomized_se_resnet9_fixup
from fusion_compiler.ir.region import Region
from fusion_compiler.glue_compile import inductor_compile
from fusion_compiler.runtime.tiered import isolated_copy
from torch._dynamo.utils import counters
torch.manual_seed(0)
model = randomized_se_resnet9_fixup().eval()
x = torch.randn(2, 3, 64, 64)
with torch.inference_mode():
    gm = fc.compile(model, cache_dir=False).specialize(x).graph_module
with torch.no_grad():
    glue = inductor_compile(isolated_copy(gm, opaque=lambda m: isinstance(m, Region)), [x])
    err = ((glue(x) - gm(x)).norm() / gm(x).norm()).item()
print(json.dumps({{"aot": dict(counters["aot_autograd"]), "err": err}}))
"""


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="Inductor's CPU code needs a C++ compiler")
def test_a_second_process_finds_the_glue_in_aotautograds_cache(tmp_path):
    """The copy of a lowered graph handed to Inductor passes AOTAutograd's cache checks (region
    wrappers pickle as what they compute, no text annotations, tensors marked as Dynamo marks
    them), so a second process loads the glue from the cache instead of tracing it again; on
    the CPU, where the regions run as their PyTorch ops."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = _AOT_CACHE_SCRIPT.format(root=str(Path(__file__).resolve().parents[1]))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Failed to pickle cache key" not in proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["aot"].get("autograd_cache_miss") == 1, runs[0]
    assert runs[1]["aot"].get("autograd_cache_hit") == 1, runs[1]
    assert all(run["err"] < 1e-5 for run in runs)


def test_an_opaque_region_wrapper_copies_as_a_wrapper_and_pickles_as_a_description():
    import copy
    import pickle

    import torch.nn as nn

    import fusion_compiler as fc
    from fusion_compiler.ir.region import Region
    from fusion_compiler.runtime.tiered import _Opaque, isolated_copy

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    with torch.inference_mode():
        gm = fc.compile(model, cache_dir=False).specialize(torch.randn(1, 3, 8, 8)).graph_module
    private = isolated_copy(gm, opaque=lambda m: isinstance(m, Region))
    wrapper = next(m for m in private.children() if isinstance(m, _Opaque))
    assert copy.deepcopy(wrapper).target is wrapper.target
    assert copy.copy(wrapper).target is wrapper.target
    text = pickle.dumps(wrapper)
    assert b"conv2d" in text  # the region's code
    with pytest.raises(TypeError, match="does not unpickle"):
        pickle.loads(text)
    with pytest.raises(TypeError, match="cannot pickle an opaque Linear"):
        pickle.dumps(_Opaque(nn.Linear(2, 2)))


def test_tritons_cache_key_is_computed_once_on_the_background_thread(monkeypatch):
    """``kernels.prewarm_triton`` hands Triton's per-process cache key to the background thread,
    once, so the first kernel launch does not compute it."""
    cache = pytest.importorskip("triton.runtime.cache")
    import fusion_compiler.kernels as kernels

    threads = []
    monkeypatch.setattr(cache, "triton_key", lambda: threads.append(threading.current_thread()),
                        raising=False)
    monkeypatch.setattr(kernels, "_prewarm_started", False)
    kernels.prewarm_triton()
    kernels.prewarm_triton()
    assert drain(60)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()



@pytest.mark.parametrize("error", ["", "ImportError: no triton"])
def test_triton_is_imported_on_the_calling_thread_before_any_background_warm_up(monkeypatch, error):
    """Two threads importing Triton at once can each see it half imported (a kernel then
    reported "Triton does not import" for the whole process, seen on an H200): the warm-up
    imports it on the calling thread first, and starts nothing where it does not import."""
    import fusion_compiler.kernels as kernels

    events = []
    monkeypatch.setattr(kernels, "triton_import_error",
                        lambda: events.append(("import", threading.current_thread())) or error)
    monkeypatch.setattr("fusion_compiler.runtime.background.submit",
                        lambda work: events.append(("submit", work)))
    monkeypatch.setattr(kernels, "_prewarm_started", False)
    kernels.prewarm_triton()
    assert events[0] == ("import", threading.current_thread())
    assert [e[0] for e in events] == (["import"] if error else ["import", "submit"])

_BACKWARD_CHOICE_SCRIPT = """
import json, sys, torch
from torch._dynamo.utils import counters
sys.path.insert(0, {root!r})
from fusion_compiler.glue_compile import inductor_without_autograd_cache
choice, backend = sys.argv[1], sys.argv[2]

@torch.library.custom_op("fc_test::region", mutates_args=())
def region(x: torch.Tensor) -> torch.Tensor:
    return x.clone()

@region.register_fake
def _(x):
    return torch.empty_like(x)

@torch.library.custom_op("fc_test::gradient_kernel", mutates_args=())
def gradient_kernel(g: torch.Tensor) -> torch.Tensor:
    return 3 * g

@gradient_kernel.register_fake
def _(g):
    return torch.empty_like(g)

# what this process chose for the region's backward: PyTorch's ops, or a kernel of its own
region.register_autograd(lambda ctx, g: 2 * g if choice == "ops"
                         else torch.ops.fc_test.gradient_kernel(g))

class Glue(torch.nn.Module):
    def forward(self, x):
        return torch.ops.fc_test.region(x.sin()).cos()

compiled = torch.compile(torch.fx.symbolic_trace(Glue()), fullgraph=True, dynamic=False,
                         backend="inductor" if backend == "inductor"
                         else inductor_without_autograd_cache)
x = torch.randn(4, 8, requires_grad=True)
compiled(x).sum().backward()
factor = (x.grad / (-x.sin().sin() * x.cos())).median().item()
print(json.dumps({{"factor": round(factor, 3), "aot": dict(counters["aot_autograd"])}}))
"""


def test_training_glue_traces_its_own_backward_instead_of_another_processs(tmp_path):
    """A region's backward (cuDNN's gradient kernels or PyTorch's ops, chosen per process) is
    not in the graph AOTAutograd's cache is keyed by, so a training glue graph compiled with that
    cache could replay another process's backward (on two H200s: a gradient kernel's key this
    process never registered). ``inductor_without_autograd_cache`` compiles without it. On the
    CPU, with a custom op whose backward is chosen per process; the second process shows that
    the scenario reaches AOTAutograd's cache."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = _BACKWARD_CHOICE_SCRIPT.format(root=str(Path(__file__).resolve().parents[1]))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def run(choice: str, backend: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", script, choice, backend],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run("ops", "inductor")
    assert first["factor"] == 2.0 and first["aot"].get("autograd_cache_miss") == 1, first
    cached = run("kernel", "inductor")  # the same graph: the first process's entry is found
    assert cached["aot"].get("autograd_cache_hit") == 1, cached
    own = run("kernel", "ours")
    assert own["factor"] == 3.0, (own, cached)
    assert not own["aot"].get("autograd_cache_hit"), own


def test_training_glue_gives_a_first_gradient_with_create_graph():
    """A first gradient with ``create_graph=True`` through training glue (the first half of a
    gradient penalty) equals eager's; the backward through it then raises AOTAutograd's own
    "does not currently support double backward", as under ``torch.compile``. (After a plain
    backward of the same compiled glue, AOTAutograd's donated buffers make the first gradient
    raise instead, naming ``torch._functorch.config.donated_buffer``, as under
    ``torch.compile``.)"""
    from fusion_compiler.glue_compile import inductor_without_autograd_cache

    class Glue(torch.nn.Module):
        def forward(self, x):
            return torch.mm(x.sin(), x.t()).cos()

    compiled = torch.compile(torch.fx.symbolic_trace(Glue()), fullgraph=True, dynamic=False,
                             backend=inductor_without_autograd_cache)
    x = torch.randn(4, 8, requires_grad=True)
    first, = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)
    want, = torch.autograd.grad(Glue()(x).sum(), x)
    torch.testing.assert_close(first, want)
    with pytest.raises(RuntimeError, match="double backward"):
        first.square().sum().backward()


def test_the_switch_lets_the_first_tiers_last_call_run_before_the_next_tier_is_built():
    """The next tier's build writes the hoisted tensors the first tier's graph reads: the
    first tier settles (its last call's work ordered before the current stream's) first."""
    order = []

    class Settling(_Tier):
        def settle(self):
            order.append("settle")

    def finish(artifact):
        order.append("finish")
        return _Tier("second")

    runner = TieredRunner(Settling("first"), lambda: "artifact", finish,
                          on_failure=lambda why: None)
    runner(1)
    assert runner.wait(10) and order == ["settle", "finish"]
