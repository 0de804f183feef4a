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
    torchrun --nproc-per-node 1 examples/train_ddp.py --ddp-overlap --bucket-cap-mb 1 \
        --slow-allreduce-us 400 --profile trace/     # a slowed all-reduce, overlapped

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

What overlapping the all-reduce with the backward buys (``fusion_compiler.compile``'s
``ddp_overlap``, off by default; ``--ddp-overlap`` turns it on): ``--bucket-cap-mb`` sets DDP's
bucket cap, and ``--slow-allreduce-us D`` registers a DDP communication hook that delays each
bucket's all-reduce by ``D`` µs of GPU time on a stream of its own (``torch.cuda._sleep``), the way
a slower interconnect would: without overlap every delay comes after the backward, with it they
run beside the rest of the backward. ``--profile DIR`` records one more step in the profiler,
after two unrecorded ones (a Chrome trace per rank in ``DIR``), and prints how much of the
communication kernels' time (NCCL's, and the hook's sleep) ran beside the other streams' kernels.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fusion_compiler as fc  # noqa: E402
from examples.plot_timeline import gpu_events, is_communication  # noqa: E402
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


def _slowed_allreduce(delay_us: float):
    """A DDP communication hook: each bucket's average all-reduce after ``delay_us`` of GPU
    sleep, on one side stream (buckets queue behind each other, as on one slow link). The sleep's
    cycles per µs are timed after a few sleeps that bring the clocks up (a single cold probe gave
    sleeps of 6 to 59% of the time asked)."""
    for _ in range(5):
        torch.cuda._sleep(2_000_000)
    probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe[0].record()
    for _ in range(10):
        torch.cuda._sleep(1_000_000)
    probe[1].record()
    probe[1].synchronize()
    cycles = int(delay_us * 10_000_000 / (probe[0].elapsed_time(probe[1]) * 1000.0))
    side = torch.cuda.Stream()

    def hook(group, bucket):  # unannotated: DDP checks annotations, and these are strings here
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            buffer = bucket.buffer().div_(dist.get_world_size())
            work = dist.all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    return hook


def _step(model: nn.Module, opt: Any, x: torch.Tensor, target: torch.Tensor,
          mark: bool) -> torch.Tensor:
    """One training step; returns the loss."""
    if mark:  # a new step for CUDA graph trees: the last step's outputs may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
    opt.zero_grad()
    loss = (model(x).float() - target).square().mean()
    opt.backward(loss)
    opt.step()
    return loss


def _overlap(trace: Path) -> str:
    """How much of the communication kernels' time (NCCL's, the slowed hook's sleep) ran while a
    kernel of another stream ran, from the GPU events of a Chrome trace that ``torch.profiler``
    wrote (the profiler's own event list, read in ``on_trace_ready`` of a scheduled profile,
    counted every communication kernel as overlapped)."""
    events = gpu_events(json.loads(trace.read_text()))
    count, total, beside = overlap_ns([
        (e["name"], e["tid"], round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000))
        for e in events if e["dur"] > 0])
    return (f"{count} communication kernels, {total / 1000:.0f} us, of which "
            f"{beside / 1000:.0f} us beside other streams' kernels")


def overlap_ns(kernels: list[tuple[str, int, int, int]]) -> tuple[int, int, int]:
    """``(name, stream, start, end)`` of GPU kernels (ns) -> the number of communication kernels
    (NCCL's; ``spin_kernel``, what ``torch.cuda._sleep`` runs), their total time and the part of
    it during which a kernel of another stream ran."""
    comm = [k for k in kernels if is_communication(k[0])]
    other = [k for k in kernels if k not in comm]
    total = beside = 0
    for _, stream, start, end in comm:
        total += end - start
        spans = sorted((max(s0, start), min(e0, end)) for _, st, s0, e0 in other
                       if st != stream and s0 < end and e0 > start)
        covered, reach = 0, start
        for s0, e0 in spans:
            if e0 > reach:
                covered += e0 - max(s0, reach)
                reach = e0
        beside += covered
    return len(comm), total, beside


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="per rank (default %(default)s)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variant", choices=VARIANTS, default="fusion_compiler")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket cap (default: DDP's, 25)")
    parser.add_argument("--slow-allreduce-us", type=float, default=0.0,
                        help="delay each bucket's all-reduce by this much GPU time (CUDA only)")
    parser.add_argument("--ddp-overlap", action="store_true",
                        help="compile the encoder with ddp_overlap=True")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="profile one more step (after two unrecorded); write a Chrome "
                        "trace per rank to DIR")
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
        encoder = fc.compile(encoder, ddp_overlap=args.ddp_overlap)
    caps = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = DDP(Agent(encoder).to(args.device, dtype), **caps)
    if args.slow_allreduce_us > 0 and cuda:
        model.register_comm_hook(None, _slowed_allreduce(args.slow_allreduce_us))
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
    step = functools.partial(_step, model, opt, x, target, mark)
    for i in range(args.warmup + args.steps):
        clock = _Clock(cuda)
        loss = step()
        if i >= args.warmup:
            times.append(clock.ms())
    if args.profile is not None and cuda:
        args.profile.mkdir(parents=True, exist_ok=True)
        trace = args.profile / f"trace_rank{rank}.json"

        def recorded(prof: torch.profiler.profile) -> None:
            prof.export_chrome_trace(str(trace))
            print(f"rank {rank} profile: {_overlap(trace)}; trace in {args.profile}", flush=True)
        # two unrecorded steps first: the profiler's tracing starts up (CUPTI) at the first
        # kernel it sees, which otherwise lands in the recorded step (1-2 ms of host time seen
        # in the first op of a step recorded alone)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    schedule=torch.profiler.schedule(wait=0, warmup=2, active=1,
                                                                     repeat=1),
                                    on_trace_ready=recorded) as prof:
            for _ in range(3):
                step()
                torch.cuda.synchronize()
                prof.step()
    ms = statistics.median(times)
    label = args.variant + (" ddp_overlap" if args.ddp_overlap else "") + (
        f" bucket {args.bucket_cap_mb:g} MB" if args.bucket_cap_mb is not None else "") + (
        f" all-reduce +{args.slow_allreduce_us:g} us" if args.slow_allreduce_us > 0 else "")
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
    del model, opt, encoder, total, step
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
