"""DistributedDataParallel on the CPU (gloo, reference backend): ``DDP(fusion_compiler.compile(m))``
and ``torch.compile(DDP(m), backend="fusion_compiler")`` give eager DDP's gradients on every rank,
and ``fusion_compiler.compile(DDP(m))`` names the fix."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_compiler import FusionError, compile as fc_compile

ROOT = Path(__file__).resolve().parents[1]

_RANK = """
import copy, json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, {root!r})
import fusion_compiler as fc
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + {init!r}, rank=rank, world_size=2)
base = randomize_(se_resnet9_fixup(3, base_planes=32), seed=1).train()
twin, dyn = copy.deepcopy(base), copy.deepcopy(base)
x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(rank))  # differ per rank
# both ranks share one cache directory: they compile one at a time (PlanCache.lock)
models = (DDP(fc.compile(base, backends=(), cache_dir={cache!r})), DDP(twin),
          # Dynamo splits the graph at DDP's bucket boundaries; each piece goes to the backend
          torch.compile(DDP(dyn), backend="fusion_compiler",
                        options={{"backends": (), "cache_dir": {cache!r}}}))
for model in models:
    model(x).square().mean().backward()

def diff(a, b):  # (a parameter behind a ReLU off for every input has zero gradients in both)
    return max((p.grad - q.grad).abs().max().item() / (q.grad.abs().max().item() or 1.0)
               for p, q in zip(a.parameters(), b.parameters()))

total = sum(p.grad.sum().item() for p in base.parameters())
print(json.dumps({{"rank": rank, "diff": diff(base, twin), "dynamo_diff": diff(dyn, twin),
                  "sum": total}}))
dist.destroy_process_group()
"""


def test_ddp_of_compiled_module_matches_eager_ddp_on_every_rank(tmp_path):
    script = _RANK.format(root=str(ROOT), init=str(tmp_path / "init"),
                          cache=str(tmp_path / "plans"))
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    results = []
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["diff"] < 1e-4 for r in results), results  # fp32, reduction order varies
    assert all(r["dynamo_diff"] < 1e-4 for r in results), results  # torch.compile(DDP(m))
    # all-reduced: both ranks hold the same gradients although their inputs differ
    assert results[0]["sum"] == pytest.approx(results[1]["sum"], rel=1e-6)


def test_compile_of_ddp_module_names_the_fix():
    ddp = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel)  # no process group needed to be refused
    torch.nn.Module.__init__(ddp)
    with pytest.raises(FusionError, match=r"DDP\(fusion_compiler.compile\(model\)\)"):
        fc_compile(ddp)


_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from fusion_compiler.runtime.plan_cache import PlanCache
with PlanCache(Path({cache!r})).lock({{"kind": "test"}}):
    print("held", flush=True)
    time.sleep(2.0)
"""


def test_plan_cache_lock_makes_other_processes_wait(tmp_path, caplog):
    """The lock DDP ranks compile under: a second process waits for the first to finish."""
    import logging
    import time

    from fusion_compiler.runtime.plan_cache import PlanCache

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(root=str(ROOT),
                                                                     cache=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="fusion_compiler"):
        with PlanCache(tmp_path).lock({"kind": "test"}, "compile the test"):
            waited = time.perf_counter() - start
    holder.wait(timeout=30)
    assert waited > 1.0
    assert "waiting for another process to compile the test" in caplog.text
    with PlanCache(None).lock({"kind": "test"}):  # no directory: nothing to lock
        pass


def test_train_ddp_example_trains_each_variant_like_eager_on_the_cpu(tmp_path):
    """``examples/train_ddp.py --device cpu`` (2 processes over gloo, torchrun), several variants
    in one process timed in turn: each DDP variant trains like eager DDP, rank by rank (the loss
    of the last step, after three updates), and ``solo`` (no DDP) trains on its own rank's data."""
    import re
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_ddp.py"), "--device", "cpu", "--batch", "2",
               "--steps", "1", "--warmup", "1", "--rounds", "2",
               "--variant", "door,fusion_compiler,eager,solo"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "FUSION_COMPILER_CACHE_DIR": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"rank (\d)/2 (\S+): [\d.]+ ms/step \(median of 2\), loss ([\d.]+)",
                       proc.stdout)
    loss = {(variant, rank): float(value) for rank, variant, value in found}
    assert len(loss) == 8, proc.stdout
    assert "eager: " in proc.stdout and "samples/s over 2 CPU processes" in proc.stdout
    assert "samples/s over one CPU process alone" in proc.stdout, proc.stdout
    for variant in ("door", "fusion_compiler"):
        for rank in "01":
            assert loss[variant, rank] == pytest.approx(loss["eager", rank], rel=1e-4), loss
    assert loss["eager", "0"] != pytest.approx(loss["eager", "1"], rel=1e-2)  # own observations
    assert loss["solo", "0"] != pytest.approx(loss["eager", "0"], rel=1e-3)  # no all-reduce


def test_train_ddp_refuses_an_unknown_variant_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_ddp.py"),
                           "--variant", "eager,fast"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--variant: 'eager,fast'" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_train_ddp_counts_communication_time_beside_other_streams():
    """``examples/train_ddp.py --profile``'s summary: the part of each communication kernel's time
    during which another stream ran a kernel (overlapping spans counted once)."""
    sys.path.insert(0, str(ROOT))
    from examples.train_ddp import overlap_ns

    kernels = [("spin_kernel", 2, 100, 400),           # beside compute 150-250 and 300-500
               ("conv", 1, 150, 250), ("relu", 1, 200, 260), ("conv", 1, 300, 500),
               ("ncclDevKernel_AllReduce", 2, 600, 700),  # alone
               ("copy", 2, 650, 680)]                   # same stream: not beside
    assert overlap_ns(kernels) == (2, 400, 210)
    assert overlap_ns([("conv", 1, 0, 10)]) == (0, 0, 0)


def _chrome_trace(path: Path) -> Path:
    """A Chrome trace as ``torch.profiler`` writes it: a CPU op, and GPU events (µs) on two
    streams: an NCCL kernel beside another stream's kernel and copy for 150 of its 300 µs."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 9, "ts": 0, "dur": 900},
              {"ph": "X", "cat": "kernel", "name": "conv", "tid": 7, "ts": 1000, "dur": 200},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "tid": 7, "ts": 1300,
               "dur": 50},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "tid": 17,
               "ts": 1100, "dur": 300},
              {"ph": "i", "cat": "kernel", "name": "marker", "tid": 7, "ts": 1000}]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_train_ddp_reads_the_overlap_from_the_trace_it_wrote(tmp_path):
    sys.path.insert(0, str(ROOT))
    from examples.train_ddp import _overlap

    # the conv covers 1100-1200, the copy 1300-1350: 150 of the NCCL kernel's 300 us
    assert _overlap(_chrome_trace(tmp_path / "t.json")) == (
        "1 communication kernels, 300 us, of which 150 us beside other streams' kernels")


def test_plot_timeline_draws_each_streams_kernels(tmp_path):
    sys.path.insert(0, str(ROOT))
    from examples.plot_timeline import kernel_spans

    trace = _chrome_trace(tmp_path / "t.json")
    assert kernel_spans(json.loads(trace.read_text())) == {
        "7": [(0, 200, "compute"), (300, 50, "copy")], "17": [(100, 300, "comm")]}
    # looked up, not imported: the drawing runs in a process of its own
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("plotting needs matplotlib (extra 'plot')")
    out = tmp_path / "timeline.png"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "plot_timeline.py"),
                           str(trace), "--labels", "one step", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 1000
