"""The ``fusion-compiler dump`` command, as the README runs it, in both formats."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = "examples.seresnet9_fixup:se_resnet9_fixup"


def _run(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("fusion-compiler")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fusion_compiler.tools.cli"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_dump_json_reference_network():
    pytest.importorskip("cudnn")
    proc = _run("dump", REF, "--input", "128x3x64x64", "--dtype", "float16", "--format", "json",
                "--fuse-prologue", "--fuse-reduction", "--no-horizontal-fusion")
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


def test_dump_default_is_a_short_summary_first():
    proc = _run("dump", REF, "--input", "128x3x64x64", "--dtype", "float16")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) < 120
    assert lines[0].startswith(f"# {REF} on ")
    header = "\n".join(lines[:8])
    assert "convolutions:   9 of 9 in fused regions (100% of 19.53 GFLOP); 6 convolutions of the " \
        "model merged into 3 (horizontal fusion)" in header
    assert "regions:        9" in header and "left to PyTorch: 0 convolution(s)" in header
    assert "=== " not in proc.stdout  # no graph code unless --stage asks for it
    out = proc.stdout
    assert out.index("9 fused regions") < out.index("ops left to PyTorch, by reason")
    # the four SE blocks' gates and tails are this package's kernels, not ops left to PyTorch
    assert "glue kernels:   se_scale x4" in header and "ops left to PyTorch, by reason: none" in out


def test_dump_text_shows_graphs_and_tables():
    proc = _run("dump", REF, "--input", "2x3x64x64", "--stage", "captured,normalize,fused",
                "--no-horizontal-fusion")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for heading in ("=== captured graph ===", "=== normalize graph ===", "=== fused graph ===",
                    "12 fused regions", "convolutions not fused: none",
                    "ops left to PyTorch, by reason"):
        assert heading in out
    assert out.index("12 fused regions") < out.index("=== captured graph ===")
    # prologue and reduction fusion are off by default: plain conv chains, the sum left to PyTorch
    assert "conv3x3 > mul > add" in out and "[add]" not in out and "+ sum_hw" not in out
    assert "sum_1 = torch.sum(getitem_19, [2, 3], keepdim = True)" in out  # the SE squeeze


def test_dump_reports_bad_arguments():
    proc = _run("dump", "examples.nope:model", "--input", "1x3x64x64")
    assert proc.returncode == 2 and "cannot load" in proc.stderr
    proc = _run("dump", REF, "--input", "1xAx64")
    assert proc.returncode == 2 and "bad input shape" in proc.stderr
    proc = _run("dump", REF, "--input", "1x11x64x64")
    assert proc.returncode == 2 and "cannot take input 0" in proc.stderr
    proc = _run("dump", REF, "--input", "1x3x64x64", "--stage", "bogus")
    assert proc.returncode == 2 and "unknown stage" in proc.stderr


def test_a_model_module_that_fails_at_import_is_one_line(tmp_path):
    (tmp_path / "broken_model.py").write_text("def model(:\n")
    exe = Path(sys.executable).with_name("fusion-compiler")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fusion_compiler.tools.cli"]
    proc = subprocess.run([*cmd, "dump", "broken_model:model", "--input", "1x3x8x8"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "SyntaxError" in proc.stderr, proc.stderr


def test_dump_dot_has_one_cluster_per_region(tmp_path):
    path = tmp_path / "graph.dot"
    proc = _run("dump", REF, "--input", "2x3x64x64", "--format", "dot", "--out", str(path))
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert text.startswith("digraph fusion_compiler {") and text.rstrip().endswith("}")
    assert text.count("subgraph cluster_r") == 9  # 12 convolutions, 6 merged in pairs
    assert text.count("{") == text.count("}")
    declared = set(re.findall(r'^\s*"([^"]+)" \[label=', text, flags=re.M))
    edges = re.findall(r'^\s*"([^"]+)" -> "([^"]+)";', text, flags=re.M)
    assert len(edges) > 9 and all(a in declared and b in declared for a, b in edges)
    # the first region's convolution reads the SpaceToDepth output from outside its cluster
    assert any(b.startswith("r0_") and not a.startswith("r0_") for a, b in edges)


def test_check_cli_passes_on_the_reference_network():
    proc = _run("check", "examples.seresnet9_fixup:randomized_se_resnet9_fixup", "--input",
                "2x3x64x64", "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["mismatched_regions"] == []
    regions = {c["region"] for c in report["comparisons"]}
    assert {f"r{i}" for i in range(12)} <= regions and None in regions


def test_bench_cli_on_cpu_times_eager_and_ours(tmp_path):
    proc = _run("bench", "examples.seresnet9_fixup:randomized_se_resnet9_fixup", "--input",
                "2x3x64x64", "--variants", "eager,eager+cudagraph,fusion_compiler", "--reps", "2",
                "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "forward, ms per call: median (q1-q3); CPU" in proc.stdout
    result = json.loads((tmp_path / "bench.json").read_text())["results"][0]
    assert result["ms"]["eager"]["median"] > 0 and result["ms"]["fusion_compiler"]["median"] > 0
    assert result["skipped"] == {"eager+cudagraph": "needs CUDA"}
    assert result["fusion_compiler"]["regions"] == {"reference": 12}  # what the defaults chose
    assert "12 fused regions" not in proc.stdout and "compile(model) chose" in proc.stdout
    # cold and warm first outputs in new processes (fusion_compiler only: reduce-overhead's
    # CUDA graphs need CUDA)
    assert result["compile_s"]["fusion_compiler, cold"] > 0
    assert result["compile_s"]["fusion_compiler, warm"] > 0


@pytest.mark.parametrize("argv, says", [
    (["check", REF, "--input", "1x3x8x8", "--device", "meta"], "is not cpu, cuda or cuda:N"),
    (["bench", REF, "--input", "1x3x8x8", "--iters", "0"], "0 is not a positive count"),
    (["bench", REF, "--input", "1x3x8x8", "--reps", "-1"], "-1 is not a positive count"),
    (["dump", REF, "--input", "1x3x8x8", "--out", "."], "is a folder; give a file name"),
    (["check", REF, "--input", "1x3x8x8", "--out", "nowhere/x.txt"], "does not exist"),
    (["bench", REF, "--input", "1x3x8x8", "--out", "README.md"], "bench writes a folder"),
])
def test_bad_arguments_are_one_line_before_any_work(argv, says, capsys, monkeypatch):
    """Checked before the model is loaded (an --out that cannot be written failed after the
    whole check with a traceback, exit 1, which for check means "mismatch"): exit 2, the
    reason on the last line (argparse's usage above it for an argument's own value)."""
    from fusion_compiler.tools import cli

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and says in err.strip().splitlines()[-1], err
    assert "Traceback" not in err


def test_inputs_too_large_to_make_are_one_line_and_exit_2(capsys, monkeypatch):
    """A traceback and exit 1, which for check means "mismatch" (helper-50)."""
    from fusion_compiler.tools import cli

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        cli.main(["check", REF, "--input", "99999999x3x1000x1000"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "the inputs cannot be made on cpu" in err, err
    assert "Traceback" not in err
