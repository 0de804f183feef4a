"""A process that built cuDNN plans exits cleanly: nothing printed after its output (the cuDNN
frontend's extension reports every object of its own still alive at interpreter exit)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import torch
    import fusion_compiler

    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU())
    model = model.cuda().half().eval()
    fast = fusion_compiler.compile(model, autotune=2)  # kept in a global until exit
    x = torch.randn(8, 16, 32, 32, device="cuda", dtype=torch.half)
    with torch.inference_mode():
        fast(x)
        fast.wait_for_background_compiles()
        y = fast(x)
    torch.cuda.synchronize()
    assert fast.last.regions[0].backend == "cudnn", fast.report()
    print("done", tuple(y.shape))
""")


@pytest.mark.parametrize("workers", ["0", "2"], ids=["in-process builds", "worker processes"])
def test_a_process_that_built_plans_exits_without_a_word(tmp_path, workers):
    env = {**os.environ, "FUSION_COMPILER_CACHE_DIR": str(tmp_path / "plans"),
           "FUSION_COMPILER_BUILD_WORKERS": workers,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "done (8, 32, 32, 32)"
    assert "nanobind" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr[-3000:]
