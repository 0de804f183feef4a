"""A DD-PPO-shaped training loop across GPUs: each rank encodes its own observations with
SE-ResNet9-Fixup and a small head, DistributedDataParallel all-reduces the gradients, fp16
weights with fp32 masters and dynamic loss scaling (``MasterWeightOptimizer``).

    torchrun --nproc-per-node 2 examples/train_ddp.py                 # compiled encoder
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant eager # the same loop, eager
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant reduce-overhead
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant door  # torch.compile(DDP(agent),
                                                                      #   backend="fusion_compiler")
    torchrun --nproc-per-node 2 examples/train_ddp.py --device cpu --batch 2 --steps 2  # a smoke
                                                                      #   run: gloo, fp32, SGD

Per rank it prints the median step time (forward, backward with the all-reduce, optimizer step;
CUDA events over ``--steps`` steps after ``--warmup``) and the loss, and rank 0 the steps per
second of the whole job. Variants: ``fusion_compiler`` (default) wraps the compiled encoder,
``DDP(Agent(fusion_compiler.compile(encoder)))``, and the ranks share the plan cache directory, so
one rank tunes and the others load its plans; ``eager`` is ``DDP(Agent(encoder))``;
``reduce-overhead`` is ``torch.compile(DDP(Agent(encoder)), mode="reduce-overhead")`` (each step
marked with ``torch.compiler.cudagraph_mark_step_begin``); ``door`` is
``torch.compile(DDP(Agent(encoder)), backend="fusion_compiler")`` (Dynamo splits the graph at
DDP's bucket boundaries, each piece compiled as ``fusion_compiler.compile`` compiles a model).
``--device cpu`` runs the same loop on the CPU over gloo, in fp32 with plain SGD and wall-clock
times: a check that a variant trains, not a benchmark.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
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


VARIANTS = ("fusion_compiler", "eager", "reduce-overhead", "door")


class Agent(nn.Module):
    """Encoder, then a linear value head on the flattened features (N, 1)."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(512 * 2 * 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.encoder(x), 1))


class _Plain:
    """The optimizer interface of ``MasterWeightOptimizer`` over fp32 parameters (``--device
    cpu``): no masters, no loss scale."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()


class _Clock:
    """ms of one step: CUDA events on the GPU, the wall clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def ms(self) -> float:
        if not self.cuda:
            return (time.perf_counter() - self.t0) * 1000.0
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="per rank (default %(default)s)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variant", choices=VARIANTS, default="fusion_compiler")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.half if cuda else torch.float
    torch.manual_seed(0)  # the same initial weights on every rank
    encoder = randomize_(se_resnet9_fixup(3)).to(args.device, dtype).train()
    if args.variant == "fusion_compiler":
        encoder = fc.compile(encoder)
    model = DDP(Agent(encoder).to(args.device, dtype))
    mark = args.variant == "reduce-overhead"
    if mark:
        model = torch.compile(model, mode="reduce-overhead")
    elif args.variant == "door":
        model = torch.compile(model, backend="fusion_compiler")
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)  # noqa: E731
    opt = (MasterWeightOptimizer(model.parameters(), sgd) if cuda
           else _Plain(sgd(model.parameters())))
    gen = torch.Generator(args.device).manual_seed(rank)  # each rank its own observations
    x = torch.randn(args.batch, 3, 64, 64, device=args.device, dtype=dtype, generator=gen)
    target = torch.randn(args.batch, 1, device=args.device, generator=gen)
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        clock = _Clock(cuda)
        if mark:  # a new step for CUDA graph trees: the last step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad()
        loss = (model(x).float() - target).square().mean()
        opt.backward(loss)
        opt.step()
        if step >= args.warmup:
            times.append(clock.ms())
    ms = statistics.median(times)
    label = args.variant
    where = torch.cuda.get_device_name() if cuda else "CPU, gloo"
    print(f"rank {rank}/{world} {label}: {ms:.2f} ms/step (median of {args.steps}), "
          f"loss {loss.item():.6f}, {where}", flush=True)
    total = torch.tensor([args.batch * 1000.0 / ms], device=args.device)
    dist.all_reduce(total)
    if rank == 0:
        print(f"{label}: {total.item():.0f} samples/s over {world} "
              f"{'GPU(s)' if cuda else 'CPU processes'}, batch {args.batch} per rank", flush=True)
    # release DDP (its reducer holds the process group) before destroying the group: left to
    # the interpreter's exit, a gloo worker thread could still be running then and abort the
    # process ("terminate called without an active exception", 6 runs in 16 on the CPU)
    del model, opt, encoder, total
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
