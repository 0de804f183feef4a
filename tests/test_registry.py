"""The settings object and the backend registry on the CPU: options validated once with one clear
error, every door's options derived from them; lowering asks the backends the ``backends`` option
names, in its order, records each region's choice once, and the first that takes a region claims
it where nothing is timed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_compiler import CompileOptions
from fusion_compiler.config import DEFAULT_BACKENDS
from fusion_compiler.backends import Backend, Lowered, Support, registry
from fusion_compiler.lowering import lower, regions_of
from conftest import CUDA_PIPELINE


def test_options_are_validated_once_with_a_clear_error():
    assert CompileOptions(cuda_graph=True).cuda_graph == "auto"
    with pytest.raises(TypeError, match="unknown compile option 'autotun'; did you mean 'autotune'"):
        CompileOptions.from_kwargs(autotun=3)
    with pytest.raises(ValueError, match="max_specializations must be at least 1, got 0"):
        CompileOptions(max_specializations=0)
    with pytest.raises(TypeError, match="tiered must be True or False"):
        CompileOptions(tiered="yes")
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        CompileOptions(cuda_graph=1)
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        CompileOptions(cuda_graph="static")  # deleted: slower, and outputs overwritten
    dump = CompileOptions(autotune=2).for_dump()
    assert (dump.cuda_graph, dump.glue_backend, dump.cuda_pipeline, dump.autotune) == (
        False, None, True, 2)
    dynamo = CompileOptions.for_dynamo({"autotune": 1})  # compile()'s defaults: a CUDA graph
    assert (dynamo.cuda_graph, dynamo.glue_backend, dynamo.autotune) == ("auto", "auto", 1)
    for mode in ("default", "reduce-overhead", "max-autotune"):
        assert CompileOptions.for_dynamo(None, mode) == CompileOptions()
    assert CompileOptions.for_dynamo(None, "max-autotune-no-cudagraphs").cuda_graph is False
    assert CompileOptions.for_dynamo({"cuda_graph": False}).cuda_graph is False
    with pytest.raises(ValueError, match="mode must be one of"):
        CompileOptions.for_dynamo(None, "fast")
    assert CompileOptions.from_kwargs(**CompileOptions(tiered=False).to_dict()).tiered is False


class _Doubling(Backend):
    """A backend for the test: takes every region whose convolution has 8 output channels and
    runs it as its own ops."""

    name = "doubling"

    def supports(self, region):
        if region.conv.meta["val"].shape[1] != 8:
            return Support(False)  # not its kind: nothing to report
        return Support(True)

    def lower(self, region, training=False, backward=None):
        return Lowered(region.graph_module, plan="the region's own ops", workspace_bytes=0)


@pytest.fixture
def doubling():
    registry.register_backend("doubling", lambda options: _Doubling())
    with pytest.raises(ValueError, match="registered already"):
        registry.register_backend("doubling", lambda options: _Doubling())
    yield
    del registry._REGISTRY["doubling"]


def _fused(model, x):
    import fusion_compiler as fc

    return fc.compile(model, glue_backend=None, options=CUDA_PIPELINE,
                      backends=()).specialize(x).graph_module


WITH_DOUBLING = CompileOptions(backends=("doubling", *DEFAULT_BACKENDS))


def test_a_registered_backend_claims_its_regions_before_the_others(doubling):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3)).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        gm = _fused(model, x)  # lowered to PyTorch ops: the regions, lowered again below
    for region in regions_of(gm):
        region.lowering = None
    lower(gm, WITH_DOUBLING)
    first, second = regions_of(gm)
    assert (first.backend, first.status, first.plan) == ("doubling", "lowered",
                                                          "the region's own ops")
    # the second is not its kind: the reason is the next backend's (no CUDA here), not its own
    assert (second.backend, second.status) == ("reference", "fallback")
    assert second.reason == "CUDA is not available on this machine"
    with pytest.raises(RuntimeError, match="lowered already"):
        lower(gm, WITH_DOUBLING)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_several_candidates_are_all_lowered_and_off_cuda_the_first_asked_is_kept(doubling):
    lowered = []

    class Second(_Doubling):
        name = "second"

        def lower(self, region, training=False, backward=None):
            lowered.append(region.region_id)
            return super().lower(region, training, backward)

    registry.register_backend("second", lambda options: Second())
    try:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
        with torch.no_grad():
            gm = _fused(model, torch.randn(2, 3, 16, 16))
        (region,) = regions_of(gm)
        region.lowering = None
        lower(gm, CompileOptions(backends=("second", "doubling")))
        assert lowered == ["r0"]  # both candidates built their kernel
        assert (region.backend, dict(region.timing)) == ("second", {})  # no GPU to time on
    finally:
        del registry._REGISTRY["second"]


def test_backends_option_names_registered_backends_in_order(doubling, caplog):
    """``backends`` takes a sequence or a comma-separated string; a name given twice, the
    reference, or a name nothing is registered under is one clear error at construction; a
    backend registered but not named is not asked; with other than the default backends a
    region left to PyTorch ops is a warning."""
    import fusion_compiler as fc

    assert CompileOptions().backends == DEFAULT_BACKENDS
    assert CompileOptions(backends="cudnn, dense").backends == ("cudnn", "dense")
    assert CompileOptions(backends=[]).backends == ()
    with pytest.raises(ValueError, match="'cudnn' given more than once"):
        CompileOptions(backends=("cudnn", "cudnn"))
    with pytest.raises(ValueError, match="'reference' .* is always the fallback"):
        CompileOptions(backends=("reference",))
    with pytest.raises(TypeError, match="backends must be a sequence of backend names"):
        CompileOptions(backends=("cudnn", 3))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    with pytest.raises(ValueError, match="no backend named 'cudn' .*registered: .*'cudnn'"):
        fc.compile(model, backends=("cudn",))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        gm = _fused(model, x)
    (region,) = regions_of(gm)
    region.lowering = None
    lower(gm, CompileOptions())  # "doubling" is registered, but not asked
    assert (region.backend, region.status) == ("reference", "fallback")
    region.lowering = None
    with caplog.at_level("INFO", logger="fusion_compiler"):
        lower(gm, CompileOptions(backends=("cudnn",)))
    assert [r.levelname for r in caplog.records if "runs on the reference" in r.message] == [
        "WARNING"]
    region.lowering = None
    lower(gm, CompileOptions(backends=("triton_stem",)))  # declines other regions silently
    assert region.reason == "no backend of triton_stem takes this kind of region"
    region.lowering = None
    lower(gm, CompileOptions(backends=()))
    assert (region.backend, region.status, region.reason) == ("reference", "lowered", "")


class _SlowerThanPyTorch(Backend):
    """A backend for the test that declines every region as cuDNN does when the region's
    PyTorch ops timed faster than its kernel."""

    name = "slower"

    def supports(self, region):
        return Support(True)

    def lower(self, region, training=False, backward=None):
        from fusion_compiler.ir.errors import UnsupportedError

        raise UnsupportedError("PyTorch ops were faster", region.region_id,
                               timing={"slower": 2.0, "reference": 1.0})


@pytest.mark.parametrize("winner", ["doubling", "reference"])
def test_a_kernel_is_timed_against_the_pytorch_ops_another_backend_lost_to(
        doubling, winner, monkeypatch):
    """Where one backend declines because the region's PyTorch ops were faster and another built
    a kernel, the kernel is timed against those ops (not taken untimed): the faster runs, and
    PyTorch ops winning keep the decline's reason."""
    from fusion_compiler import lowering

    registry.register_backend("slower", lambda options: _SlowerThanPyTorch())
    timed = []

    def fastest(region, lowered, cache):
        timed.append(sorted(lowered))
        return winner, {name: 1.0 if name == winner else 3.0 for name in lowered}

    monkeypatch.setattr(lowering, "_fastest", fastest)
    try:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
        gm = _fused(model, torch.randn(2, 3, 8, 8))
        regions_of(gm)[0].lowering = None
        lower(gm, CompileOptions(backends=("doubling", "slower")))
    finally:
        del registry._REGISTRY["slower"]
    region = regions_of(gm)[0]
    assert timed == [["doubling", "reference"]]
    assert region.backend == winner
    assert region.timing["reference"] == (1.0 if winner == "reference" else 3.0)
    if winner == "reference":
        assert region.status == "fallback" and "PyTorch ops were faster" in region.reason


@pytest.mark.parametrize("options,timed", [({}, "as compiled glue runs them"),
                                           ({"glue_backend": None}, "eager ops")])
def test_the_pytorch_ops_are_timed_as_the_glue_will_run_them(doubling, options, timed,
                                                             monkeypatch):
    """Lowering times a region's PyTorch ops as compiled glue runs them (one pass after the
    convolution) unless the options leave the glue eager: then as the region's own ops."""
    from fusion_compiler import lowering
    from fusion_compiler.backends.glue_stand_in import timed_as

    registry.register_backend("slower", lambda options: _SlowerThanPyTorch())
    seen = []

    def fastest(region, lowered, cache):
        seen.append(timed_as())
        return "reference", {name: 1.0 for name in lowered}

    monkeypatch.setattr(lowering, "_fastest", fastest)
    try:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
        gm = _fused(model, torch.randn(2, 3, 8, 8))
        regions_of(gm)[0].lowering = None
        lower(gm, CompileOptions(backends=("doubling", "slower"), **options))
    finally:
        del registry._REGISTRY["slower"]
    assert seen == [timed] and timed_as() == "as compiled glue runs them"
