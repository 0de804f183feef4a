"""``fusion_compiler.bench`` on the CPU: training steps, unknown variants, the tables (the GPU
figures come from ``fusion-compiler bench`` runs, never from a timed test)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_compiler.bench import bench, format_results, time_ms, write


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
    paths = write([result], tmp_path)
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.txt") in paths


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="unknown variant"):
        bench(_model().eval(), [torch.randn(1, 3, 8, 8)], variants=["eagre"], progress=False)


def test_time_ms_reports_median_and_quartiles():
    t = time_ms(lambda: torch.randn(64, 64) @ torch.randn(64, 64), "cpu", reps=5, iters=None)
    assert t["q1"] <= t["median"] <= t["q3"] and t["iters"] >= 1 and t["reps"] == 5
