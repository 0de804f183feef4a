"""``torch.compile(DDP(agent), backend="fusion_compiler")`` trains with eager DDP's gradients in a
new process whose plan cache is warm, not only in the one that filled it.

Dynamo's DDPOptimizer hands over one graph per bucket, compiled and captured one after another.
A later graph's plans could need a larger cuDNN workspace than an earlier, already captured graph
had; the workspace used to be replaced and freed, and the earlier graph's kernels then wrote into
memory handed to other tensors (on two H200s: non-finite gradients from the second step of every
warm run, the loss scale halving at each step, and a job that hung). Ranks launched by torchrun
per run (the process group stays out of the test process): one rank; and two, over NCCL with a
GPU each where there are two GPUs, else both on the one GPU over gloo (NCCL refuses two ranks
on one GPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_gpu_ddp import backend

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]

_WORKER = """
import copy, json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, {root!r})
import fusion_compiler  # noqa: F401  (registers the backend from a source checkout)
from fusion_compiler.dynamo import _LIVE  # the graphs the backend compiled (this process's)
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
from examples.train_ddp import Agent
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group({backend!r})
torch.manual_seed(0)
agent = Agent(randomize_(se_resnet9_fixup(3), seed=1)).cuda().half().train()
twin = copy.deepcopy(agent)
gen = torch.Generator("cuda").manual_seed(rank)  # each rank its own data
x = torch.randn(512, 3, 64, 64, device="cuda", dtype=torch.half, generator=gen)
door = torch.compile(DDP(agent, bucket_cap_mb=2), backend="fusion_compiler",
                     options={{"cache_dir": {cache!r}}})
eager = DDP(twin, bucket_cap_mb=2)
steps = []
for step in range(4):  # later replays must see the earlier updates and valid memory
    for model in (door, eager):
        model.zero_grad(set_to_none=True)
        (model(x).float().square().mean() * 1024).backward()
    errs = sorted(((p.grad.float() - q.grad.float()).norm()
                   / q.grad.float().norm().clamp_min(1e-30)).item()
                  for p, q in zip(agent.parameters(), twin.parameters()))
    finite = all(bool(torch.isfinite(p.grad).all()) for p in agent.parameters())
    steps.append({{"finite": finite, "median_grad_err": errs[len(errs) // 2],
                  "checksum": sum(p.grad.double().sum().item() for p in agent.parameters())}})
    with torch.no_grad():
        for p, q in zip(agent.parameters(), twin.parameters()):
            p.sub_(q.grad, alpha=1e-5)  # the same update for both copies
            q.sub_(q.grad, alpha=1e-5)
# every region of the last training specialization of each graph (one per bucket): on cuDNN, or
# on PyTorch's ops where autotuning timed them faster, never by a fallback
regions = [r for graph in _LIVE for m in graph.bindings if m.last is not None
           for r in m.last.regions]
fallbacks = [(r.region_id, r.pattern, r.reason) for r in regions if r.status != "lowered"
             and not r.reason.startswith("PyTorch ops were faster")]
# a file per rank: the ranks' lines on one stdout can interleave (seen on two H200s)
with open(os.path.join({out!r}, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"steps": steps, "regions": len(regions), "fallbacks": fallbacks}}, f)
del door, eager
dist.destroy_process_group()
"""


def _run(tmp_path: Path, ranks: int) -> list[dict]:
    """Per rank: ``steps``, per step the gradients finite, their median relative L2 difference to
    eager DDP's, and their sum (equal on every rank after the all-reduce); ``regions``, the
    number of regions in the graphs' last specializations, and ``fallbacks``, those of them on
    PyTorch's ops other than by timing."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=str(ROOT), cache=str(tmp_path / "cache"),
                                     out=str(tmp_path), backend=backend(ranks)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(ranks), str(script)], capture_output=True, text=True,
                          timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _check(run: str, results: list[dict]) -> None:
    print(run, json.dumps(results))
    for result in results:  # the regions ran on GPU kernels: eager's gradients are no tautology
        assert result["regions"] and not result["fallbacks"], (run, result)
    results = [result["steps"] for result in results]
    for steps in results:
        assert all(s["finite"] for s in steps), (run, steps)
        assert all(s["median_grad_err"] < 1e-2 for s in steps), (run, steps)
    for step in range(len(results[0])):  # the ranks agree
        assert len({steps[step]["checksum"] for steps in results}) == 1, (run, results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_door_under_ddp_trains_with_eager_gradients_cold_and_warm(tmp_path):
    for run in ("cold", "warm"):  # the second process finds every plan in the cache
        _check(run, _run(tmp_path, ranks=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_door_under_ddp_with_two_ranks_gives_eager_gradients_on_both(tmp_path):
    """Two ranks (NCCL on two GPUs, gloo on one), each its own data: every step's gradients are
    eager DDP's on each rank (so the all-reduce averaged what eager's did) and equal across
    ranks, cold and warm."""
    for run in ("cold", "warm"):
        _check(run, _run(tmp_path, ranks=2))
