"""A DD-PPO-shaped training loop across GPUs: each rank encodes its own observations with
SE-ResNet9-Fixup and a small head, DistributedDataParallel all-reduces the gradients, fp16
weights with fp32 masters and dynamic loss scaling (``MasterWeightOptimizer``).

    torchrun --nproc-per-node 2 examples/train_ddp.py                 # compiled encoder
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant eager # the same loop, eager
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant reduce-overhead

Per rank it prints the median step time (forward, backward with the all-reduce, optimizer step;
CUDA events over ``--steps`` steps after ``--warmup``) and the loss, and rank 0 the steps per
second of the whole job. Variants: ``fusion_compiler`` (default) wraps the compiled encoder,
``DDP(Agent(fusion_compiler.compile(encoder)))``, and the ranks share the plan cache directory, so
one rank tunes and the others load its plans; ``eager`` is ``DDP(Agent(encoder))``;
``reduce-overhead`` is ``torch.compile(DDP(Agent(encoder)), mode="reduce-overhead")`` (each step
marked with ``torch.compiler.cudagraph_mark_step_begin``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fusion_compiler as fc  # noqa: E402
from examples.seresnet9_fixup import randomize_, se_resnet9_fixup  # noqa: E402
from examples.train_seresnet9 import MasterWeightOptimizer  # noqa: E402


VARIANTS = ("fusion_compiler", "eager", "reduce-overhead")


class Agent(nn.Module):
    """Encoder, then a linear value head on the flattened features (N, 1)."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(512 * 2 * 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.encoder(x), 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="per rank (default %(default)s)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variant", choices=VARIANTS, default="fusion_compiler")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    torch.manual_seed(0)  # the same initial weights on every rank
    encoder = randomize_(se_resnet9_fixup(3)).cuda().half().train()
    if args.variant == "fusion_compiler":
        encoder = fc.compile(encoder)
    model = DDP(Agent(encoder).cuda().half())
    mark = args.variant == "reduce-overhead"
    if mark:
        model = torch.compile(model, mode="reduce-overhead")
    opt = MasterWeightOptimizer(model.parameters(),
                                lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))
    gen = torch.Generator("cuda").manual_seed(rank)  # each rank its own observations
    x = torch.randn(args.batch, 3, 64, 64, device="cuda", dtype=torch.half, generator=gen)
    target = torch.randn(args.batch, 1, device="cuda", generator=gen)
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        if mark:  # a new step for CUDA graph trees: the last step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad()
        loss = (model(x).float() - target).square().mean()
        opt.backward(loss)
        opt.step()
        end.record()
        end.synchronize()
        if step >= args.warmup:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    label = args.variant
    print(f"rank {rank}/{world} {label}: {ms:.2f} ms/step (median of {args.steps}), "
          f"loss {loss.item():.4f}, {torch.cuda.get_device_name()}", flush=True)
    total = torch.tensor([args.batch * 1000.0 / ms], device="cuda")
    dist.all_reduce(total)
    if rank == 0:
        print(f"{label}: {total.item():.0f} samples/s over {world} GPU(s), batch {args.batch} "
              f"per rank", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
