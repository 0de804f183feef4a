"""``fusion_compiler.bench`` on the CPU: training steps, unknown variants, the tables (the GPU
figures come from ``fusion-compiler bench`` runs, never from a timed test)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_compiler.tools.bench import bench, format_results, time_ms, write


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1))


def test_training_step_variants_and_tables(tmp_path):
    torch.manual_seed(0)
    model = _model().train()
    before = [p.clone() for p in model.parameters()]
    result = bench(model, [torch.randn(2, 3, 8, 8)], train=True, reps=2, iters=1,
                   variants=["eager", "fusion_compiler", "fusion_compiler+cudagraph"],
                   progress=False)
    assert result["train"] and result["ms"]["eager"]["median"] > 0
    assert result["ms"]["fusion_compiler"]["median"] > 0
    assert result["skipped"] == {"fusion_compiler+cudagraph": "needs CUDA"}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # copies trained
    assert "backward per region" in result["gradients"]
    text = format_results([result])
    assert "training step (forward + backward), ms per call" in text and "Sequential" in text
    assert set(result["host_load"]) == {"eager", "fusion_compiler"}  # what ran was timed
    assert f"host load (1-minute average, {result['cpus']} CPUs) as each timing began: eager" \
        in text
    paths = write([result], tmp_path)
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.txt") in paths


@pytest.mark.parametrize("train", [False, True])
def test_mixed_precision_recipe(train):
    """``amp=True``: fp32 parameters, calls under autocast (bf16 on the CPU), and in training a
    GradScaler and an SGD step in each timed step, on the variant's own copy."""
    torch.manual_seed(0)
    model = _model().train(train)
    before = [p.clone() for p in model.parameters()]
    result = bench(model, [torch.randn(2, 3, 8, 8)], train=train, reps=2, iters=1, amp=True,
                   variants=["eager", "fusion_compiler"], progress=False)
    assert result["dtype"] == "float32, autocast bfloat16" and not result["errors"], result
    assert result["ms"]["fusion_compiler"]["median"] > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if not train:  # bf16 against the fp32 reference
        assert 0 < result["rel_err_vs_fp32"]["fusion_compiler"] < 5e-2


def test_variants_not_asked_for_are_not_compiled(monkeypatch):
    from fusion_compiler.tools.bench import variants as module

    def compiled(*args, **kwargs):
        raise AssertionError("a fusion_compiler variant was compiled")

    monkeypatch.setattr(module, "new_batch_seconds", compiled)
    monkeypatch.setattr(module, "compile_model", compiled)
    result = bench(_model().eval(), [torch.randn(2, 3, 8, 8)], variants=["eager"], reps=2,
                   iters=1, progress=False)
    assert list(result["ms"]) == ["eager"] and not result["errors"]


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="unknown variant"):
        bench(_model().eval(), [torch.randn(1, 3, 8, 8)], variants=["eagre"], progress=False)


def test_time_ms_reports_median_and_quartiles():
    t = time_ms(lambda: torch.randn(64, 64) @ torch.randn(64, 64), "cpu", reps=5, iters=None)
    assert t["q1"] <= t["median"] <= t["q3"] and t["iters"] >= 1 and t["reps"] == 5


def test_kernel_categories_split_gpu_time_per_call():
    """Kernel names as an H100 profile of a compiled training step shows them."""
    from fusion_compiler.tools.bench import format_time_split, kernel_categories

    kernels = [("cudnn_generated_fort_native_sm90_convFwd_pointwise_pointwise", 80.0),
               ("sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc", 60.0),
               ("sm90_xmma_wgrad_indexed_implicit_gemm_f16f16_f16f32_f32", 40.0),
               ("triton_red_fused_sum_threshold_backward_52", 20.0),
               ("nvjet_sm90_hsh_32x64_64x16_2x1_v_bz_splitK_NTN", 10.0),
               ("Memcpy DtoD (Device -> Device)", 10.0),
               ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>", 4.0)]
    split = kernel_categories(kernels * 2, calls=2)
    assert {k: round(v["ms"], 3) for k, v in split.items()} == {
        "conv forward": 0.08, "conv dgrad": 0.06, "conv wgrad": 0.04, "triton glue": 0.02,
        "gemm": 0.01, "copies": 0.01, "other": 0.004, "total": 0.224}
    assert split["total"]["kernels"] == 7
    result = {"model": "m", "inputs": [(2, 3)], "dtype": "float16", "ms": {"v": {"median": 0.3}},
              "kernel_time": {"v": split}}
    assert split["triton glue"]["slowest"] == ["triton_red_fused_sum_threshold_backward_52", 20.0]
    line, *slowest = format_time_split([result]).splitlines()
    assert line.startswith("m 2x3 float16: v: kernels 0.224 ms in 7; gaps 0.076 ms: ")
    assert "conv forward 0.080 (1)" in line
    assert "    slowest triton glue: triton_red_fused_sum_threshold_backward_52 20.0 us" in slowest
    result["ms"]["v"]["median"] = 0.2  # kernels on two streams at once
    assert "; overlap 0.024 ms: " in format_time_split([result]).splitlines()[0]


def test_tuning_table_gives_the_chosen_plans_tflops():
    """The autotuning table's TFLOP/s: the region's convolution FLOPs over the chosen plan's time
    (timings made up here: on the CPU nothing is tuned)."""
    import dataclasses

    import fusion_compiler as fc
    from fusion_compiler.backends.cudnn.autotune import PlanTiming
    from fusion_compiler.ir.ops import conv_flops
    from fusion_compiler.tables import format_tuning

    spec = fc.compile(_model().eval()).specialize(torch.randn(2, 3, 8, 8))
    region = spec.regions[1]
    region.lowering = dataclasses.replace(region.lowering, tuning=(
        PlanTiming(0, "engA", 0.004, 0.1), PlanTiming(1, "engB", 2e-6, 0.2),
        PlanTiming(2, "engC", None, 0.1, reason="failed")), timing={"cudnn": 2e-6,
                                                                   "reference": 3e-6})
    flops = conv_flops(region.conv, region.graph_module)
    assert flops == 2 * (2 * 8 * 8 * 8) * (8 * 3 * 3)
    table = format_tuning(spec.regions)
    assert "TFLOP/s" in table and "2/3" in table and "#1 engB" in table
    assert "cudnn 0.0000 (73.7), PyTorch 0.0000 (49.2)" in table
    assert f"{flops / 2e-6 / 1e9:.1f}" == "73.7" and "73.7" in table


def test_new_process_runs_report_their_cache_lookups():
    """``first_output.py`` prints Inductor's and AOTAutograd's cache lookups (from Dynamo's
    counters) before its seconds; the compile table leaves them out and a line per run says
    them."""
    from torch._dynamo.utils import counters

    from fusion_compiler.tools.bench.first_output import cache_lookups

    counters.clear()
    counters["inductor"]["fxgraph_cache_hit"] += 1
    counters["aot_autograd"]["autograd_cache_bypass"] += 1
    assert cache_lookups() == {"fxgraph": {"hit": 1}, "aot_autograd": {"bypass": 1}}
    counters.clear()
    assert cache_lookups() == {}
    result = {"model": "Net", "inputs": [[2, 3, 8, 8]], "dtype": "float32", "device": "cpu",
              "gpu": "cpu", "torch": torch.__version__, "train": False, "first": "fusion_compiler",
              "ms": {"eager": {"median": 1.0, "q1": 1.0, "q3": 1.0}},
              "compile_s": {"fusion_compiler, warm": 1.0,
                            "fusion_compiler, warm caches": {"fxgraph": {"hit": 1},
                                                             "aot_autograd": {"hit": 1}}}}
    text = format_results([result])
    assert "fusion_compiler, warm: cache lookups fxgraph 1 hit; aot_autograd 1 hit" in text
    assert "warm caches" not in text
