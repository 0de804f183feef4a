"""A CUDA-graphed training step inside DistributedDataParallel, split at DDP's buckets
(``ddp_overlap``): one forward and backward graph pair per stage, gradients equal to eager DDP's,
and each stage's gradients reach DDP's hooks when that stage's backward graph ends, before the
earlier stages' replay. One GPU, one NCCL rank (a subprocess: the process group stays out of the
test process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]

_WORKER = """
import copy, json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, {root!r})
import fusion_compiler as fc
from fusion_compiler.runtime import cuda_graph_training as cgt
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup
dist.init_process_group("nccl", rank=0, world_size=1)
base = randomize_(se_resnet9_fixup(3), seed=1).cuda().half().train()
twin = copy.deepcopy(base)
x = torch.randn(64, 3, 64, 64, device="cuda", dtype=torch.half)
compiled = fc.compile(base, cache_dir={cache!r}, ddp_overlap={overlap})
wrapped = (DDP(compiled, bucket_cap_mb=1), DDP(twin, bucket_cap_mb=1))
replays = [0]
backward = cgt._GraphPair.backward
def counted(self, *a):
    replays[0] += 1
    return backward(self, *a)
cgt._GraphPair.backward = counted
arrival = {{}}
def arrived(i):
    def hook(p):
        arrival.setdefault(i, replays[0])
    return hook
for i, p in enumerate(base.parameters()):
    p.register_post_accumulate_grad_hook(arrived(i))
for step in range(3):  # later steps' replays must see the earlier updates
    for model in wrapped:
        model.zero_grad(set_to_none=True)
        replays[0] = 0
        arrival.clear()
        (model(x).float().square().mean() * 1024).backward()
        if model is wrapped[0]:
            seen = sorted(set(arrival.values()))
    if step < 2:
        with torch.no_grad():
            for p, q in zip(base.parameters(), twin.parameters()):
                p.sub_(q.grad, alpha=1e-5)
                q.sub_(q.grad, alpha=1e-5)
errs = [((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-30)).item()
        for p, q in zip(base.parameters(), twin.parameters())]
run = compiled.last.run
print(json.dumps({{"cuda_graph": compiled.last.cuda_graph, "notes": compiled.last.notes,
                  "pairs": len(getattr(run, "pairs", [])),
                  "arrival": seen,
                  "median_grad_err": sorted(errs)[len(errs) // 2], "max_grad_err": max(errs)}}))
del wrapped
dist.destroy_process_group()
"""


def _run(tmp_path: Path, overlap: bool) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(root=str(ROOT), cache=str(tmp_path / "cache"),
                                     overlap=overlap))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stages_hand_their_gradients_to_ddp_as_their_backward_ends(tmp_path):
    got = _run(tmp_path, overlap=True)
    assert got["cuda_graph"] == "safe", got
    assert got["pairs"] > 2  # 1 MB buckets over 9.4 MB of fp16 weights
    # the last stage's parameters reach DDP after the first backward replay, and so on
    assert got["arrival"] == list(range(1, got["pairs"] + 1)), got
    assert got["median_grad_err"] < 5e-3, got
    off = _run(tmp_path, overlap=False)
    assert off["pairs"] == 1 and off["arrival"] == [1], off
    assert off["median_grad_err"] < 5e-3, off
