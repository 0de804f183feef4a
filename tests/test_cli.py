"""The ``fusion-compiler dump`` command, as the README runs it, in both formats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = "examples.seresnet9_fixup:se_resnet9_fixup"


def _run(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("fusion-compiler")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fusion_compiler.cli"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_dump_json_reference_network():
    pytest.importorskip("cudnn")
    proc = _run("dump", REF, "--input", "128x3x64x64", "--dtype", "float16", "--format", "json",
                "--fuse-prologue", "--fuse-reduction")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    regions = report["regions"]
    assert len(regions) >= 12
    assert report["unfused"] == []
    for r in regions:
        assert {"id", "pattern", "nodes", "backend", "status", "reason", "cudnn_graph"} <= set(r)
        assert r["cudnn_graph"]["nodes"], r["id"]
    prologues = [r for r in regions if r["pattern"].startswith("[add]")]
    assert len(prologues) == 11  # every Fixup conv starts with its `x + bias` prologue
    assert sum(r["pattern"].endswith("+ sum_hw") for r in regions) == 4  # the SE squeezes
    assert any("[N,K,1,1]" in row["reason"] for row in report["pytorch"])


def test_dump_text_shows_graphs_and_tables():
    proc = _run("dump", REF, "--input", "2x3x64x64", "--stage", "captured,normalize,fused")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for heading in ("=== captured graph ===", "=== normalize graph ===", "=== fused graph ===",
                    "12 fused regions", "convolutions not fused: none", "ops left to PyTorch:"):
        assert heading in out
    # prologue and reduction fusion are off by default: plain conv chains, the sum left to PyTorch
    assert "conv3x3 > mul > add" in out and "[add]" not in out and "+ sum_hw" not in out
    assert "reduction fusion is off" in out


def test_dump_reports_bad_arguments():
    proc = _run("dump", "examples.nope:model", "--input", "1x3x64x64")
    assert proc.returncode == 2 and "cannot load" in proc.stderr
    proc = _run("dump", REF, "--input", "1xAx64")
    assert proc.returncode == 2 and "bad input shape" in proc.stderr
    proc = _run("dump", REF, "--input", "1x11x64x64")
    assert proc.returncode == 2 and "do not fit the model" in proc.stderr
    proc = _run("dump", REF, "--input", "1x3x64x64", "--stage", "bogus")
    assert proc.returncode == 2 and "unknown stage" in proc.stderr
