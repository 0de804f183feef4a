"""``torch.compile(model, backend="fusion_compiler")``: inference, training and graph breaks (CPU,
reference backend; the GPU path is the same CompiledModule that test_gpu.py covers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import rel_err

from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler.config import CompileOptions
from fusion_compiler.dynamo import DynamoGraph, fusion_compiler_backend
from test_fuse_patterns import BasicBlock, _randomize_bn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording_backend(seen: list, options: CompileOptions | None = None):
    def backend(gm, example_inputs, **kwargs):
        run = (DynamoGraph(gm, example_inputs, options) if options is not None
               else fusion_compiler_backend(gm, example_inputs, **kwargs))
        seen.append(run)  # run.compiled_module: the CompiledModule of its last call
        return run
    return backend


def test_backend_name_is_registered_and_inference_matches_eager():
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).eval()
    compiled = torch.compile(model, backend="fusion_compiler")  # found through the entry point
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5


def test_dynamo_graph_is_fused_into_regions():
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).eval()
    seen = []
    compiled = torch.compile(model, backend=_recording_backend(seen))
    with torch.no_grad():
        compiled(torch.randn(2, 3, 64, 64))
    assert len(seen) == 1
    regions = seen[0].compiled_module.last.regions
    assert len(regions) == 12  # the same regions as fusion_compiler.compile finds
    assert "conv1x1 > relu > add" in [r.pattern for r in regions]


@pytest.mark.parametrize("derived", [False, True], ids=["autograd", "derived_backward"])
def test_training_gradients_match_eager(derived):
    """Parameters arrive as Dynamo graph inputs; with ``derived_backward`` the regions run
    through the custom op and its registered backward, as cuDNN regions do on a GPU."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).train()
    twin = randomize_(se_resnet9_fixup(3)).train()
    twin.load_state_dict(model.state_dict())
    seen = []
    compiled = torch.compile(model, backend=_recording_backend(
        seen, CompileOptions().internal(derived_backward=derived)))
    x = torch.randn(2, 3, 64, 64)
    compiled(x).square().mean().backward()
    twin(x).square().mean().backward()
    nonzero = 0
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        if not q.grad.any():  # a ReLU dead for this input in eager too (layer2.conv1 here)
            assert not p.grad.any(), name
            continue
        nonzero += 1
        assert rel_err(p.grad, q.grad) < 1e-4, name
    assert nonzero >= len(list(twin.parameters())) - 2
    regions = seen[0].compiled_module.last.regions
    assert len(regions) == 12
    assert all((r.kernel is not r.graph_module) == derived for r in regions)


class _Broken(nn.Module):
    """Two ResNet blocks with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = BasicBlock(8, 8), BasicBlock(8, 16, 2)

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y)


def test_graph_breaks_compile_each_graph():
    torch.manual_seed(0)
    model = _randomize_bn(_Broken()).eval()
    seen = []
    compiled = torch.compile(model, backend=_recording_backend(seen))
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        assert rel_err(compiled(x), model(x)) < 1e-5
    assert len(seen) == 2 and all(g.compiled_module.last.regions for g in seen)


def test_options_and_modes_pass_through():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    for kwargs in ({"options": {"backends": (), "cuda_graph": False}},
                   {"mode": "reduce-overhead"}, {"mode": "max-autotune-no-cudagraphs"}):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fusion_compiler", **kwargs)
        with torch.no_grad():
            assert rel_err(compiled(x), model(x)) < 1e-6, kwargs
    from fusion_compiler.dynamo import wait_for_background_compiles

    assert wait_for_background_compiles(timeout=60)  # nothing runs in the background on a CPU
    torch._dynamo.reset()
    bad = torch.compile(model, backend="fusion_compiler", options={"cuda_grph": False})
    with pytest.raises(Exception, match="did you mean 'cuda_graph'"):
        bad(x)


def test_parameters_are_bound_by_identity():
    """Dynamo passes the parameters as graph inputs and reuses one graph for two instances of a
    module class: each instance's tensors get a binding of their own, and in-place updates of
    a parameter reach the compiled graph."""
    torch.manual_seed(0)
    seen = []
    backend = _recording_backend(seen)
    one, two = (_randomize_bn(BasicBlock(8, 8)).eval() for _ in range(2))
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        for model in (one, two, one):
            assert rel_err(torch.compile(model, backend=backend)(x), model(x)) < 1e-5
        one.conv1.weight.mul_(2)
        assert rel_err(torch.compile(one, backend=backend)(x), one(x)) < 1e-5
    assert len(seen) == 1 and len(seen[0].bindings) == 2  # one graph, two bindings
    assert all(len(m.last.regions) == 2 for m in seen[0].bindings)


_NO_ENTRY_POINTS = """
import importlib.metadata as md
md.entry_points = lambda **kw: md.EntryPoints([])  # as in a source checkout: nothing installed
{before}
import torch
import fusion_compiler
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
x = torch.randn(2, 3, 8, 8)
with torch.no_grad():
    out = torch.compile(model, backend="fusion_compiler")(x)
assert torch.allclose(out, model(x), atol=1e-5)
print("ok")
"""


@pytest.mark.parametrize("before", ["", "import torch._dynamo"])
def test_import_registers_the_backend_without_an_entry_point(before):
    """``import fusion_compiler`` is enough, whether Dynamo is imported before it or after."""
    proc = subprocess.run([sys.executable, "-c", _NO_ENTRY_POINTS.format(before=before)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_import_does_not_import_dynamo():
    proc = subprocess.run([sys.executable, "-c", "import sys, fusion_compiler; "
                           "print('torch._dynamo' in sys.modules)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


_INSTALLED = """
{before}
import torch
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
x = torch.randn(2, 3, 8, 8)
compiled = torch.compile(model, backend="fusion_compiler")
{between}
with torch.no_grad():
    out = compiled(x)
{after}
assert torch.allclose(out, model(x), atol=1e-5)
print("ok", "fusion_compiler" in sys.modules)
"""


@pytest.mark.parametrize("before,between,after", [
    ("import sys", "", ""),  # no import of the package: the entry point alone
    ("import sys, fusion_compiler", "", ""),
    ("import sys, torch._dynamo, fusion_compiler", "", ""),
    ("import sys", "import fusion_compiler", ""),
    ("import sys", "", "import fusion_compiler"),
], ids=["no import", "import first", "after dynamo", "before the call", "after the call"])
def test_the_installed_backend_works_with_or_without_the_import(before, between, after):
    """Installed, Dynamo loads the backend from its entry point; the package's import must not
    register the name a second time ("duplicate name"), whenever it happens."""
    from importlib.metadata import entry_points

    if "fusion_compiler" not in entry_points(group="torch_dynamo_backends").names:
        pytest.skip("the package is not installed (pip install -e .): no entry point")
    script = _INSTALLED.format(before=before, between=between, after=after)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok True"


def test_any_batch_sequence_gives_eagers_outputs_and_gradients():
    """After its first recompile Dynamo makes the batch dimension dynamic; each graph keeps its
    own graph untouched by the passes (they rewrite a copy), so every specialization starts from
    it: batch sizes in any order give eager's outputs, in inference and in training."""
    from examples.seresnet9_fixup import randomized_se_resnet9_fixup

    torch.manual_seed(0)
    model = randomized_se_resnet9_fixup()
    compiled = torch.compile(model, backend="fusion_compiler")
    for n in (8, 4, 2, 5, 1, 8):
        x = torch.randn(n, 3, 64, 64)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        model.train()
        model.zero_grad()
        compiled(x).square().mean().backward()
        got = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad()
        model(x).square().mean().backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(got[k], p.grad, rtol=1e-3, atol=1e-5, msg=k)


def test_integer_inputs_become_constants_of_each_specialization():
    """A dynamic Dynamo graph takes its batch size as a ``SymInt`` input; each specialization
    is for one size, so the passes see the value (the SpaceToDepth stem pass copies the
    reshapes that use it into a region) and nothing reads the input any more."""
    torch.manual_seed(0)
    model = randomize_(se_resnet9_fixup(3)).eval()
    seen = []
    compiled = torch.compile(model, backend=_recording_backend(seen))
    with torch.no_grad():
        for n in (4, 2, 3):
            x = torch.randn(n, 3, 64, 64)
            assert rel_err(compiled(x), model(x)) < 1e-5
    gm = seen[-1].compiled_module.last.graph_module
    sizes = [p for p in gm.graph.find_nodes(op="placeholder") if isinstance(p.meta.get("val"), int)]
    assert sizes and not any(p.users for p in sizes)


class _InferenceBlock(nn.Module):
    def __init__(self, graph_break: bool):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.graph_break = graph_break

    def forward(self, x):
        y = self.c1(x)
        with torch.inference_mode():  # a prior computed without gradients
            z = self.c2(torch.ones(x.shape[0], 4, 8, 8))
            if self.graph_break:
                torch._dynamo.graph_break()
            z = z + 1
        return y + z.clone()


@pytest.mark.parametrize("graph_break", [False, True])
def test_an_inference_mode_block_records_no_gradients(graph_break):
    """Dynamo writes the block as _enter/_exit_inference_mode calls, which the passes did not
    know as a mode: its convolution's parameters got gradients where eager gives none
    (helper-55). The block is a no_grad block now; the caller's mode is left as it was."""
    torch.manual_seed(0)
    model = _InferenceBlock(graph_break)
    compiled = torch.compile(model, backend="fusion_compiler")
    x = torch.randn(2, 3, 8, 8)
    for _ in range(2):
        compiled(x).square().sum().backward()
        assert model.c2.weight.grad is None and model.c1.weight.grad is not None
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
