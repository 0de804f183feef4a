"""``fusion_compiler.check``: passes on the reference network, names a region broken on purpose
(forward and, in training, backward), and uses the tolerance of the dtype (CPU, reference
backend; the GPU fuzz in test_fuzz.py runs the same check on cuDNN regions)."""

from __future__ import annotations

import pytest
import torch

from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from fusion_compiler import check
from fusion_compiler.tools.check import TOLERANCES, tolerance
from fusion_compiler.compiler import CompiledModule
from conftest import relowered


def _model(train: bool = False) -> torch.nn.Module:
    return randomize_(se_resnet9_fixup(3, base_planes=16), seed=1).train(train)


def test_check_passes_and_leaves_the_model_alone():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = check(model, torch.randn(2, 3, 64, 64))
    assert report.ok and report.mismatched_regions == []
    assert [c.name for c in report.comparisons if c.region is None] == ["output 0"]
    assert len({c.region for c in report.comparisons if c.region}) == 12
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "check passed" in report.format()


def test_check_names_the_region_broken_in_its_forward():
    model = _model()
    x = torch.randn(2, 3, 64, 64)
    compiled = CompiledModule(model, backends=())
    with torch.no_grad():
        region = compiled.specialize(x).regions[4]
    relowered(region, kernel=lambda *a: tuple(o * 1.05 for o in region.graph_module(*a)))
    report = check(compiled, x)
    assert not report.ok
    assert report.mismatched_regions == ["r4"]  # errors do not carry over to later regions
    assert any(c.region is None and not c.ok for c in report.comparisons)  # nor hide at the end
    text = report.format()
    assert "MISMATCH" in text and "check FAILED: regions r4" in text


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times 3: a backward broken on purpose."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_check_train_names_the_region_broken_in_its_backward():
    model = _model(train=True)
    x = torch.randn(2, 3, 64, 64)
    compiled = CompiledModule(model, backends=())
    region = compiled.specialize(x).regions[2]  # a training specialization (grad enabled)
    kernel = region.kernel
    relowered(region, kernel=lambda image, *rest: kernel(_ScaleGrad.apply(image), *rest))
    report = check(compiled, x, train=True)
    assert report.mismatched_regions == ["r2"]
    bad = [c.name for c in report.comparisons if not c.ok and c.region == "r2"]
    assert bad and all(name.startswith("grad of") for name in bad)  # its forward is right
    assert any(c.name.startswith("grad ") and c.region is None and not c.ok
               for c in report.comparisons)


def test_check_train_passes_with_gradients_of_every_parameter():
    model = _model(train=True)
    report = check(model, torch.randn(2, 3, 64, 64), train=True)
    assert report.ok, report.format()
    grads = {c.name for c in report.comparisons if c.region is None}
    assert {f"grad {n}" for n, _ in model.named_parameters()} <= grads
    assert any(c.name.startswith("grad of") for c in report.comparisons if c.region)


def test_tolerances_follow_the_dtype():
    assert tolerance(torch.float16, "cpu") == TOLERANCES[torch.float16]
    assert tolerance(torch.float32, "cpu") < tolerance(torch.bfloat16, "cpu")
    with torch.backends.cudnn.flags(allow_tf32=True):  # fp32 on CUDA may run as TF32
        assert tolerance(torch.float32, "cuda") == TOLERANCES[torch.float16]
    with torch.backends.cudnn.flags(allow_tf32=False):
        assert tolerance(torch.float32, "cuda") == TOLERANCES[torch.float32]
    with pytest.raises(ValueError, match="no tolerance"):
        tolerance(torch.int32, "cpu")


def test_region_check_narrows_an_image_the_graph_padded_for_cudnn():
    """A cuDNN region whose image the graph zero-padded (``Region.padded_images``, inference)
    gets it with 8 channels; its own ops, run as the fp64 reference, take the 3 it declares."""
    from fusion_compiler.tools.check import _own_args
    from fusion_compiler.ir.region import called_region

    compiled = CompiledModule(torch.nn.Conv2d(3, 8, 3).eval(), glue_backend=None)
    with torch.no_grad():
        gm = compiled.specialize(torch.randn(2, 3, 8, 8)).graph_module
    region = next(r for n in gm.graph.nodes if (r := called_region(gm, n)) is not None)
    x, w = torch.randn(2, 8, 8, 8), torch.randn(8, 3, 3, 3)
    x[:, 3:] = 0
    assert _own_args(region, (x, w))[0].shape == (2, 8, 8, 8)  # nothing padded: as given
    relowered(region, padded_images={0: 8})
    narrowed, weight = _own_args(region, (x, w))
    assert narrowed.shape == (2, 3, 8, 8) and torch.equal(narrowed, x[:, :3]) and weight is w
    # an ordering input past the region's own (runtime.streams) is not the region's
    own = (x, w, torch.randn(8))  # image, weight, bias
    assert len(list(region.graph_module.graph.find_nodes(op="placeholder"))) == 3
    assert _own_args(region, (*own, torch.randn(2, 8, 6, 6)))[2] is own[2]
    assert len(_own_args(region, (*own, torch.randn(2, 8, 6, 6)))) == 3


class _DropoutArgmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.nn.functional.dropout(self.conv(x), 0.5, self.training)
        return y, y.argmax(1)


def test_check_seeds_random_draws_and_compares_integer_outputs():
    """Dropout in training mode draws the same mask in each run (an output error of 1.05 passed
    as "within twice eager's error", eager's own error being as large); an integer output is
    compared too (it was left out: "check passed" on a model whose only output was argmax)."""
    torch.manual_seed(0)
    report = check(_DropoutArgmax().train(), torch.randn(2, 3, 8, 8), train=True)
    assert report.ok, report.format()
    by_name = {c.name: c for c in report.comparisons}
    assert by_name["output 0"].error < 1e-5 and by_name["output 0"].eager_error < 1e-5
    assert by_name["output 0 (int64)"].error == 0.0


def test_check_train_needs_something_to_differentiate():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).requires_grad_(False)
    with pytest.raises(ValueError, match="needs a floating output"):
        check(model.train(), torch.randn(1, 3, 8, 8), train=True)


def test_eager_error_vouches_for_a_compiled_value_only_where_eager_repeats_itself():
    """A value within twice eager's error passes (ill-conditioned in the dtype: a pure
    cancellation here, 1.7e-3 in fp32), but not where eager gives other values when run again:
    then the forward is not one function of its inputs, and a compiled value 75% off passed
    beside eager's 44% (helper-50, a forward that read a counter between calls). The report
    says why."""
    from fusion_compiler.tools.check import CheckReport, Comparison

    class Cancels(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return (self.conv(x) + 1e5) - 1e5

    torch.manual_seed(0)
    assert check(Cancels().eval(), torch.randn(2, 3, 16, 16)).ok
    fp32 = TOLERANCES[torch.float32]
    bad = Comparison("output 0", None, 0.75, 0.44, fp32, eager_unsound=True)
    assert not bad.ok and Comparison("output 0", None, 0.75, 0.44, fp32).ok
    text = CheckReport("float32", "cpu", False, ["2x3x16x16"], [bad]).format()
    assert "eager gave other values" in text and "check FAILED" in text
