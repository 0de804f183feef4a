"""A user's first hour, on the CPU: eager's output shape for every input rank PyTorch takes, one
short error for inputs the model does not take, a warning for a model without convolutions,
results a person reads (the check's table, the report's summary within 100 columns), and the
command line's errors as one line with exit status 2."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("conv,shape", [
    (nn.Conv2d(3, 8, 3, padding=1), (3, 8, 8)), (nn.Conv2d(3, 8, 3, padding=1), (2, 3, 8, 8)),
    (nn.Conv1d(3, 8, 3), (3, 16)), (nn.Conv1d(3, 8, 3), (2, 3, 16)),
    (nn.Conv3d(3, 8, 3), (3, 4, 8, 8)), (nn.Conv3d(3, 8, 3), (2, 3, 4, 8, 8))])
def test_every_input_rank_pytorch_takes_gives_eagers_output_shape(conv, shape):
    torch.manual_seed(0)
    model = nn.Sequential(conv, nn.ReLU(), type(conv)(8, 4, 1)).eval()
    x = torch.randn(shape)
    with torch.no_grad():
        got, want = fc.compile(model)(x), model(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


def _formatted(exc: BaseException) -> list[str]:
    return "".join(traceback.format_exception(exc)).splitlines()


@pytest.mark.parametrize("shape,says", [
    ((3, 64, 64), "expected 4, got 3"), ((2, 5, 64, 64), "to have 48 channels, but got 80")])
def test_an_input_the_model_does_not_take_is_one_short_error(shape, says):
    model = randomize_(se_resnet9_fixup(3)).eval()
    compiled = fc.compile(model)
    with torch.no_grad():
        compiled(torch.randn(2, 3, 64, 64))
        with pytest.raises(fc.InputError) as caught:
            compiled(torch.randn(shape))
    exc = caught.value
    text = str(exc)
    got = "x".join(map(str, shape))
    assert f"cannot take input 0 {got}:float32@cpu" in text and says in text
    assert "earlier calls took 2x3x64x64:float32@cpu" in text
    assert exc.__cause__ is None and exc.__suppress_context__
    lines = _formatted(exc)
    assert len(lines) <= 15, "\n".join(lines)
    assert not any("fusion_compiler/passes" in line or "fusion_compiler/capture" in line
                   or "fusion_compiler/shapes" in line
                   for line in lines)


def test_wrong_count_and_dtype_are_short_input_errors():
    """A wrong count is a ``TypeError``; an input of a dtype the model does not take gets
    eager PyTorch's own message (a model may take inputs of other dtypes: masks, steps)."""
    compiled = fc.compile(nn.Sequential(nn.Conv2d(3, 8, 3)).eval())
    for args, error, says in [
            ((torch.randn(1, 3, 8, 8), torch.randn(1)), TypeError,
             r"takes 1 input \(input\), got 2"),
            ((torch.randn(1, 3, 8, 8, dtype=torch.float64),), ValueError,
             r"1x3x8x8:float64@cpu: Input type \(double\)")]:
        with pytest.raises(error, match=says) as caught:
            compiled(*args)
        assert isinstance(caught.value, fc.InputError) and len(_formatted(caught.value)) <= 15


def test_a_model_without_convolutions_warns_that_nothing_is_fused(caplog):
    compiled = fc.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with caplog.at_level(logging.WARNING, logger="fusion_compiler"):
        compiled(torch.randn(2, 4))
        compiled(torch.randn(3, 4))  # once per model, not per specialization
    warned = [r for r in caplog.records if "nothing will be fused" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_results_read_as_tables_within_100_columns():
    model = randomize_(se_resnet9_fixup(3)).eval()
    x = torch.randn(2, 3, 64, 64)
    report = fc.check(model, x)
    assert str(report) == report.format() and "check passed" in str(report)
    compiled = fc.compile(model)
    with torch.no_grad():
        compiled(x)
    text = compiled.report()
    lines = text.splitlines()
    assert lines[0] == "# SEResNet9Fixup" and lines[1].startswith("inputs:")
    assert "12 of 12 in fused regions" in text and "ops left to PyTorch" in text
    assert max(len(line) for line in lines) <= 100


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("fusion-compiler")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fusion_compiler.tools.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300,
                          cwd=env.pop("cwd") if env and "cwd" in env else ROOT,
                          env={**os.environ, **(env or {})})


_MODELS = textwrap.dedent("""
    import torch

    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)

        def forward(self, x):
            return self.conv(x) if x.sum() > 0 else x

    def data_dependent():
        return DataDependent()

    def raising():
        raise RuntimeError("the weights file is missing")

    def small():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
""")


@pytest.mark.parametrize("args,says", [
    (["dump", "user_models:data_dependent", "--input", "2x3x8x8"], "symbolic_trace failed"),
    (["dump", "user_models:raising", "--input", "2x3x8x8"],
     "user_models:raising raised RuntimeError: the weights file is missing"),
    (["check", "user_models:small", "--input", "2x5x8x8"], "cannot take input 0 2x5x8x8"),
    (["bench", "user_models:small", "--input", "2x3x64", "--no-compile-times"],
     "does not run on inputs of shape 2x3x64"),
    (["dump", "user_models:missing", "--input", "2x3x8x8"], "cannot load"),
])
def test_cli_user_errors_are_one_line_and_exit_2(tmp_path, args, says):
    (tmp_path / "user_models.py").write_text(_MODELS)
    proc = _cli(*args, env={"cwd": tmp_path})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fusion-compiler: error: ")
    assert says in lines[0] and "Traceback" not in proc.stderr
    debug = _cli(*args, "--debug", env={"cwd": tmp_path})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_cli_device_cuda_without_cuda_is_one_line(tmp_path):
    proc = _cli("dump", "examples.seresnet9_fixup:se_resnet9_fixup", "--input", "2x3x64x64",
                "--device", "cuda")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"fusion-compiler: error: --device cuda: CUDA is not "
                                   f"available on this machine (torch {torch.__version__}); use "
                                   f"--device cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA shows")
def test_a_cpu_dump_says_first_what_it_shows_and_what_runs_here():
    proc = _cli("dump", "examples.seresnet9_fixup:se_resnet9_fixup", "--input", "2x3x64x64")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert "the regions a CUDA GPU gets" in first and "runs every region as its own PyTorch" \
        in first
    assert "fallback x12" not in proc.stdout and "% of the FLOPs on cuDNN" not in proc.stdout
    assert "each run as its own PyTorch ops here" in proc.stdout


def test_bench_says_what_it_builds_and_documents_its_files(tmp_path):
    proc = _cli("bench", "examples.seresnet9_fixup:se_resnet9_fixup", "--input", "2x3x64x64",
                "--variants", "eager,fusion_compiler", "--no-compile-times", "--reps", "2",
                "--iters", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.splitlines()
    assert "bench: building and calling fusion_compiler ..." in err
    assert any(line.startswith("fusion_compiler: ") and "ms per call" in line for line in err)
    assert "compile(model) chose: regions" in proc.stdout and "{'cuda_graph'" not in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"bench.json", "bench.txt"}
    help_text = _cli("bench", "--help").stdout
    assert all(name in " ".join(help_text.split())
               for name in ("bench.json", "bench.txt", "bench.png"))
