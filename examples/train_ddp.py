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
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant fusion_compiler,door,solo \
        --rounds 5                                   # variants timed in turn, one process a rank
    torchrun --nproc-per-node 2 examples/train_ddp.py --variant fusion_compiler,door \
        --bucket-cap-mb 1 --slow-allreduce-us 400 --profile trace/  # a slowed all-reduce

Per rank and variant it prints the median step time (forward, backward with the all-reduce,
optimizer step; CUDA events over ``--steps`` steps after ``--warmup``) and the loss, and rank 0
the samples per second of the whole job. Variants: ``fusion_compiler`` (default) wraps the
compiled encoder, ``DDP(Agent(fusion_compiler.compile(encoder)))``, and the ranks share the plan
cache directory, so one rank tunes and the others load its plans; ``eager`` is
``DDP(Agent(encoder))``;
``reduce-overhead`` is ``torch.compile(DDP(Agent(encoder)), mode="reduce-overhead")`` (each step
marked with ``torch.compiler.cudagraph_mark_step_begin``); ``door`` is
``torch.compile(DDP(Agent(encoder)), backend="fusion_compiler")`` (Dynamo splits the graph at
DDP's bucket boundaries, each piece compiled as ``fusion_compiler.compile`` compiles a model);
``solo`` is ``Agent(fusion_compiler.compile(encoder))`` without DDP, each rank training its own
copy: one GPU's step, measured beside the others (rank 0 then says how many times one GPU's
throughput each DDP variant reaches). ``--device cpu`` runs the same loop on the CPU over gloo,
in fp32 with plain SGD and wall-clock times: a check that a variant trains, not a benchmark.

Several variants (``--variant a,b,...``) are built in one process, from the same initial
weights, and timed in turn, ``--steps`` steps each, ``--rounds`` times: a slow spell of the host
then hits every variant, where separate processes differed by up to 15% on one machine. Each
variant trains on the same batch for the same number of steps, so their losses should agree.

What overlapping the all-reduce with the backward buys: ``--bucket-cap-mb`` sets DDP's bucket
cap, and ``--slow-allreduce-us D`` registers a DDP communication hook that delays each bucket's
all-reduce by ``D`` µs of GPU time on a stream of its own (``torch.cuda._sleep``), the way a
slower interconnect would: where the whole backward is one CUDA graph (``fusion_compiler``) every
delay comes after it; in eager and in the door (one graph per bucket group) they can run beside
the rest of the backward. ``--profile DIR`` records one more step of each
variant in the profiler, after two unrecorded ones (a Chrome trace per variant and rank in
``DIR``), and prints how much of the communication kernels' time (NCCL's, and the hook's sleep)
ran beside the other streams' kernels.
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


VARIANTS = ("fusion_compiler", "door", "eager", "reduce-overhead", "solo")


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


def _build(variant: str, args: argparse.Namespace, dtype: torch.dtype) -> tuple[Any, Any]:
    """``(model, optimizer)`` of one variant, from the same initial weights as every other."""
    cuda = args.device == "cuda"
    torch.manual_seed(0)  # the same initial weights on every rank and in every variant
    encoder = randomize_(se_resnet9_fixup(3)).to(args.device, dtype).train()
    if variant in ("fusion_compiler", "solo"):
        encoder = fc.compile(encoder)
    model = Agent(encoder).to(args.device, dtype)
    if variant != "solo":
        caps = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
        model = DDP(model, gradient_as_bucket_view=args.bucket_view, **caps)
        if args.slow_allreduce_us > 0 and cuda:
            model.register_comm_hook(None, _slowed_allreduce(args.slow_allreduce_us))
    if variant == "reduce-overhead":
        model = torch.compile(model, mode="reduce-overhead")
    elif variant == "door":
        model = torch.compile(model, backend="fusion_compiler")
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)  # noqa: E731
    opt = (MasterWeightOptimizer(model.parameters(), sgd) if cuda
           else _Plain(sgd(model.parameters())))
    return model, opt


def _profile(step: Any, directory: Path, name: str, rank: int) -> None:
    """Profile one more ``step()`` after two unrecorded ones; write its Chrome trace to
    ``directory/{name}_rank{rank}.json`` and print the overlap summary."""
    directory.mkdir(parents=True, exist_ok=True)
    trace = directory / f"{name}_rank{rank}.json"

    def recorded(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(trace))
        print(f"rank {rank} {name} profile: {_overlap(trace)}; trace {trace}", flush=True)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024, help="per rank (default %(default)s)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    parser.add_argument("--variant", default="fusion_compiler", metavar="V[,V...]",
                        help=f"one or several of {', '.join(VARIANTS)} (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the variants in turn this many times, --steps each")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket cap (default: DDP's, 25)")
    parser.add_argument("--bucket-view", action="store_true",
                        help="DDP(..., gradient_as_bucket_view=True): one copy per gradient "
                        "fewer")
    parser.add_argument("--slow-allreduce-us", type=float, default=0.0,
                        help="delay each bucket's all-reduce by this much GPU time (CUDA only)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="profile one more step of each variant (after two unrecorded); "
                        "write a Chrome trace per variant and rank to DIR")
    args = parser.parse_args()
    variants = args.variant.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(set(variants)) != len(variants):
        parser.error(f"--variant: {args.variant!r}: give distinct names of {', '.join(VARIANTS)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.half if cuda else torch.float
    gen = torch.Generator(args.device).manual_seed(rank)  # each rank its own observations
    x = torch.randn(args.batch, 3, 64, 64, device=args.device, dtype=dtype, generator=gen)
    target = torch.randn(args.batch, 1, device=args.device, generator=gen)
    steps, times, losses = {}, {v: [] for v in variants}, {}
    for v in variants:
        model, opt = _build(v, args, dtype)
        steps[v] = functools.partial(_step, model, opt, x, target, v == "reduce-overhead")
        for _ in range(args.warmup):
            steps[v]()
    for _ in range(args.rounds):  # variants in turn: a slow spell of the host hits them all
        for v in variants:
            for _ in range(args.steps):
                clock = _Clock(cuda)
                losses[v] = steps[v]()
                times[v].append(clock.ms())
    if args.profile is not None and cuda:
        for v in variants:
            _profile(steps[v], args.profile, v, rank)
    ddp_flags = (f" bucket {args.bucket_cap_mb:g} MB" if args.bucket_cap_mb is not None else ""
                 ) + (" bucket view" if args.bucket_view else "") + (
        f" all-reduce +{args.slow_allreduce_us:g} us" if args.slow_allreduce_us > 0 else "")
    label = {v: v + ("" if v == "solo" else ddp_flags) for v in variants}
    where = torch.cuda.get_device_name() if cuda else "CPU, gloo"
    rates = {}
    for v in variants:
        ms = statistics.median(times[v])
        print(f"rank {rank}/{world} {label[v]}: {ms:.2f} ms/step (median of "
              f"{len(times[v])}), loss {losses[v].item():.6f}, {where}", flush=True)
        total = torch.tensor([args.batch * 1000.0 / ms], device=args.device)
        dist.all_reduce(total)
        rates[v] = total.item() / (world if v == "solo" else 1)  # solo: one GPU's own rate
    if rank == 0:
        units = ("GPU", "GPUs") if cuda else ("CPU process", "CPU processes")
        for v in variants:
            over = (f"one {units[0]} alone (mean of ranks), no DDP" if v == "solo" else
                    f"{world} {units[world > 1]}")
            versus = (f", {rates[v] / rates['solo']:.2f}x solo" if "solo" in variants
                      and v != "solo" else "")
            print(f"{label[v]}: {rates[v]:.0f} samples/s over {over}, batch {args.batch} per "
                  f"rank{versus}", flush=True)
    # release DDP (its reducer holds the process group) before destroying the group: left to
    # the interpreter's exit, a gloo worker thread could still be running then and abort the
    # process ("terminate called without an active exception", 6 runs in 16 on the CPU)
    del steps, losses, model, opt
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
