"""Benchmark: fusion_compiler side by side with eager PyTorch and torch.compile.

Every variant of a model is timed in the same process on the same GPU with CUDA events: the
median over ``--reps`` repetitions of ``--iters`` back-to-back calls after warm-up, in ms per call
(the method of shared/BASELINES.md). With several ``--models`` each model runs in a process of its
own. Inputs are NCHW fp16 and weights fp16, as the reference agent runs; ``--channels-last``
stores every variant's parameters channels_last (the inputs stay NCHW; the eager training
variants then compute wrong AvgPool gradients, pytorch/pytorch#188344: they are timed, not
checked).

    python examples/benchmark.py --out bench_out            # all models, all variants
    python examples/benchmark.py --models seresnet9-rgb --profile
    python examples/benchmark.py --models seresnet9-rgb-train   # the training step

Inference models time one forward. ``*-train`` models time one training step: forward, loss (mean
of squares), backward and an SGD step (momentum 0.9) on fp32 master weights with a static loss
scale (``examples.train_seresnet9.MasterWeightOptimizer(dynamic=False)``, capturable); "AMP" is
fp32 weights with the forward under ``torch.autocast(float16)`` and SGD on the fp32 weights.
"+cudagraph" variants capture the whole step (static input; the gradients autograd hands over
live in the graph's memory pool) in one CUDA graph; "reduce-overhead" lets torch.compile's CUDA
graph trees capture forward and backward.

Prints a table (GPU name, ms per variant, compile times), for training the per-region backward
timings, writes ``bench.json`` and a bar plot ``bench.png``. Inference compile times are measured
in new processes, from just before ``import fusion_compiler`` (or the ``torch.compile`` call) to the
first output, the model already on the GPU: "cold" with empty plan and Inductor cache directories,
"warm" with the directories the cold run filled; "new batch" is the first call at half the batch
size of a module already compiled (and called) at the full one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


MODELS = {
    # name: (factory, input shape)
    "seresnet9-rgb": ("examples.seresnet9_fixup:se_resnet9_fixup", (128, 3, 64, 64), {}),
    "seresnet9-depth": ("examples.seresnet9_fixup:se_resnet9_fixup", (512, 11, 64, 64),
                        {"in_channels": 11}),
    "resnet50": ("torchvision.models:resnet50", (128, 3, 224, 224), {}),
    "seresnet9-rgb-train": ("examples.seresnet9_fixup:se_resnet9_fixup", (2048, 3, 64, 64), {}),
}
VARIANTS = ["eager", "eager+cudagraph", "torch.compile", "torch.compile reduce-overhead",
            "fusion_compiler defaults", "fusion_compiler cuda_graph=static",
            "fusion_compiler glue=None", "fusion_compiler cuda_graph=False",
            "fusion_compiler cuda_graph=False glue=inductor"]
# the options of each fusion_compiler inference variant (compile(model, **options))
OPTIONS = {"fusion_compiler defaults": {}, "fusion_compiler cuda_graph=static": {"cuda_graph": "static"},
           "fusion_compiler glue=None": {"glue_backend": None},
           "fusion_compiler cuda_graph=False": {"cuda_graph": False},  # glue "auto": eager ops
           "fusion_compiler cuda_graph=False glue=inductor": {"cuda_graph": False,
                                                             "glue_backend": "inductor"}}
TRAIN_VARIANTS = ["eager AMP", "eager fp16", "eager fp16+cudagraph", "fusion_compiler fp16",
                  "fusion_compiler fp16+cudagraph", "fusion_compiler fp16+inductor glue",
                  "fusion_compiler fp16+inductor glue+cudagraph", "torch.compile fp16",
                  "torch.compile reduce-overhead fp16"]


def tuned(autotune: int | None) -> dict:
    """``compile()``'s ``autotune`` option when ``--autotune`` was given (else its default)."""
    return {} if autotune is None else {"autotune": autotune}


def build_model(name: str, channels_last: bool = False) -> torch.nn.Module:
    """Model ``name`` of ``MODELS`` on the GPU in fp16 (train mode for ``*-train``), its
    parameters NCHW-contiguous as constructed or, with ``channels_last``, converted by
    ``model.to(memory_format=torch.channels_last)``."""
    import importlib

    ref, _, kwargs = MODELS[name]
    module, attr = ref.split(":")
    model = getattr(importlib.import_module(module), attr)(**kwargs)
    if name.startswith("seresnet9"):
        from examples.seresnet9_fixup import randomize_

        randomize_(model)
    model = model.cuda().half().train(name.endswith("-train"))
    return model.to(memory_format=torch.channels_last) if channels_last else model


def time_ms(fn: Callable[[], object], reps: int, iters: int) -> float:
    """Median over ``reps`` of (CUDA-event time of ``iters`` back-to-back calls) / ``iters``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def timed_build(make: Callable[[], Callable[[], object]]) -> tuple[Callable[[], object], float]:
    """Build a variant and run it once; returns the callable and the seconds that took."""
    t0 = time.perf_counter()
    fn = make()
    fn()
    torch.cuda.synchronize()
    return fn, time.perf_counter() - t0


def measure_variant(result: dict, variant: str, make: Callable[[], Callable[[], object]],
                    reps: int, iters: int) -> Callable[[], object] | None:
    """Build and time one variant into ``result`` (``compile_s``, ``ms``); returns its callable.
    A variant that fails to build or run gets ``ms = None`` and its error in ``result["errors"]``
    (report and go on: one broken variant must not hide the rest), and ``None`` is returned."""
    try:
        fn, seconds = timed_build(make)
        result["compile_s"][variant] = seconds
        result["ms"][variant] = time_ms(fn, reps, iters)
        return fn
    except Exception as exc:
        result["ms"][variant] = None
        result.setdefault("errors", {})[variant] = " ".join(str(exc).split())[:300]
        return None


def _first_output_seconds(name: str, variant: str, cache_dir: str, inductor_dir: str,
                          autotune: int, channels_last: bool) -> float:
    """Seconds to the first output of ``variant`` in a new process (see module docstring)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir}
    proc = subprocess.run([sys.executable, __file__, "--compile-only", name, "--variant", variant,
                           "--cache-dir", cache_dir]
                          + ["--autotune", str(autotune)] * (autotune is not None)
                          + ["--channels-last"] * channels_last,
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return float(proc.stdout.strip().splitlines()[-1])


def new_process_compile_seconds(name: str, autotune: int, channels_last: bool) -> dict:
    """Cold and warm compile-to-first-output seconds of fusion_compiler's defaults (and warm with
    ``glue_backend=None``) and of torch.compile reduce-overhead, each in new processes; cold runs
    get fresh plan and Inductor cache directories, warm runs the ones their cold run filled."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="fc-cold-") as tmp:
        for label, variant, warm_too in (
                ("fusion_compiler defaults", "fusion_compiler defaults", True),
                ("torch.compile reduce-overhead", "torch.compile reduce-overhead", True)):
            plans, inductor = tempfile.mkdtemp(dir=tmp), tempfile.mkdtemp(dir=tmp)
            for run in ("cold", "warm") if warm_too else ("cold",):
                try:
                    out[f"{label}, {run}"] = _first_output_seconds(
                        name, variant, plans, inductor, autotune, channels_last)
                except Exception as exc:  # report and go on
                    out[f"{label}, {run}"] = None
                    print(f"{label} {run} compile failed: {' '.join(str(exc).split())[-300:]}")
            if variant == "fusion_compiler defaults":  # warm, no Inductor glue
                out["fusion_compiler glue=None, warm"] = _first_output_seconds(
                    name, "fusion_compiler glue=None", plans, inductor, autotune, channels_last)
    return out


def own_process(name: str, args: argparse.Namespace) -> dict:
    """Benchmark one model in a new Python process and return its result.

    Each model gets a fresh process: torch.compile's caches and CUDA graph pools from one model's
    variants would otherwise carry over to the next (the training step of torch.compile
    reduce-overhead measured 7.1 ms after the inference models in one process, 3.8 ms alone, on
    an H200).
    """
    with tempfile.TemporaryDirectory(prefix="fc-bench-") as tmp:
        path = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--models", name, "--reps", str(args.reps),
                   "--iters", str(args.iters), "--result-json", str(path)]
        if args.autotune is not None:
            command += ["--autotune", str(args.autotune)]
        if args.variants:
            command += ["--variants", args.variants]
        if args.profile:
            command.append("--profile")
        if args.channels_last:
            command.append("--channels-last")
        subprocess.run(command, check=True, cwd=ROOT)
        return json.loads(path.read_text())


def bench_model(name: str, variants: list[str], reps: int, iters: int, profile: bool,
                autotune: int | None, channels_last: bool = False) -> dict:
    import fusion_compiler as fc
    from fusion_compiler.runtime.cuda_graph import CudaGraphRunner

    torch.manual_seed(0)
    model = build_model(name, channels_last)
    x = torch.randn(MODELS[name][1], device="cuda", dtype=torch.half)
    cache_dir = tempfile.mkdtemp(prefix="fc-plans-")

    def ours(variant: str) -> Callable[[], object]:
        module = fc.compile(model, [x], cache_dir=cache_dir, **tuned(autotune), **OPTIONS[variant])
        if variant == "fusion_compiler defaults":
            from fusion_compiler.report import format_tuning

            spec = module.specialize(x)
            result["tuning"] = format_tuning(spec.regions)
            result["defaults"] = {"cuda_graph": spec.cuda_graph, "glue": spec.glue_backend,
                                  "notes": spec.notes}
        return lambda: module(x)

    makers = {
        "eager": lambda: (lambda: model(x)),
        "eager+cudagraph": lambda: (lambda r=CudaGraphRunner(model, [x], copy_outputs=False): r(x)),
        "torch.compile": lambda: (lambda m=torch.compile(model): m(x)),
        "torch.compile reduce-overhead": lambda: (
            lambda m=torch.compile(model, mode="reduce-overhead"): m(x)),
        **{variant: (lambda v=variant: ours(v)) for variant in OPTIONS},
    }
    result = {"model": name, "input": list(x.shape), "ms": {}, "compile_s": {},
              "channels_last": channels_last}
    with torch.inference_mode():
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # true fp32 convs
            reference = copy.deepcopy(model).float()(x.float())

        def rel_err(out: torch.Tensor) -> float:
            return ((out.float() - reference).abs().max() / reference.abs().max()).item()

        result["rel_err_vs_fp32"] = {"eager": rel_err(model(x))}
        for variant in variants:
            fn = measure_variant(result, variant, makers[variant], reps, iters)
            if fn is None:
                continue
            if variant.startswith("fusion_compiler"):
                result["rel_err_vs_fp32"][variant] = rel_err(fn())
            if profile and variant in ("fusion_compiler defaults",
                                       "torch.compile reduce-overhead"):
                result.setdefault("profiles", {})[variant] = kernel_profile(fn)
        if "fusion_compiler defaults" in variants:
            half = x[: x.shape[0] // 2].clone()
            for variant in ("fusion_compiler defaults", "fusion_compiler glue=None"):
                module = fc.compile(model, cache_dir=cache_dir, **tuned(autotune),
                                    **OPTIONS[variant])
                module(x)  # compiled (and called) at the full batch size first
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                module(half)
                torch.cuda.synchronize()
                result["compile_s"][f"{variant}, new batch"] = time.perf_counter() - t0
    result["compile_s"].update(new_process_compile_seconds(name, autotune, channels_last))
    return result


def train_step(model: torch.nn.Module, run: Callable, x: torch.Tensor, amp: bool = False
               ) -> Callable[[], object]:
    """One training step of ``run`` (the model, or a compiled form of it) on ``x``."""
    from examples.train_seresnet9 import MasterWeightOptimizer

    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9)  # noqa: E731
    if amp:
        opt = sgd(list(model.parameters()))

        def step():
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = run(x).float().square().mean()
            loss.backward()
            opt.step()
    else:
        opt = MasterWeightOptimizer(model.parameters(), sgd, init_scale=1024.0, dynamic=False)

        def step():
            opt.zero_grad()
            opt.backward(run(x).float().square().mean())
            opt.step()
    return step


def step_marked(run: Callable) -> Callable:
    """``run`` preceded by ``torch.compiler.cudagraph_mark_step_begin()``: tells CUDA graph trees
    that a new training step starts, so the previous step's outputs may be overwritten."""
    def marked(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return run(*args)
    return marked


def graphed(step: Callable[[], object], warmup: int = 3) -> Callable[[], object]:
    """Capture ``step`` (static inputs) in one CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def bench_training(name: str, variants: list[str], reps: int, iters: int, autotune: int | None,
                   profile: bool = False, channels_last: bool = False) -> dict:
    import fusion_compiler as fc

    torch.manual_seed(0)
    base = build_model(name, channels_last)
    x = torch.randn(MODELS[name][1], device="cuda", dtype=torch.half)
    cache_dir = tempfile.mkdtemp(prefix="fc-plans-")
    result = {"model": name, "input": list(x.shape), "ms": {}, "compile_s": {}, "train": True,
              "channels_last": channels_last}

    def fresh(dtype=torch.half):
        return copy.deepcopy(base).to(dtype)  # keeps the parameters' memory format

    def ours(model, cuda_graph, glue_backend=None):
        module = fc.compile(model, cache_dir=cache_dir, glue_backend=glue_backend,
                            **tuned(autotune))
        step = train_step(model, module, x)
        step()  # compiles the training specialization
        from fusion_compiler.report import format_gradients

        result["gradients"] = format_gradients(module.last.regions)
        return graphed(step) if cuda_graph else step

    makers = {
        "eager AMP": lambda: train_step(m := fresh(torch.float32), m, x, amp=True),
        "eager fp16": lambda: train_step(m := fresh(), m, x),
        "eager fp16+cudagraph": lambda: graphed(train_step(m := fresh(), m, x)),
        "torch.compile fp16": lambda: train_step(m := fresh(), torch.compile(m), x),
        "torch.compile reduce-overhead fp16": lambda: train_step(
            m := fresh(), step_marked(torch.compile(m, mode="reduce-overhead")), x),
        "fusion_compiler fp16": lambda: ours(fresh(), False),
        "fusion_compiler fp16+cudagraph": lambda: ours(fresh(), True),
        "fusion_compiler fp16+inductor glue": lambda: ours(fresh(), False, "inductor"),
        "fusion_compiler fp16+inductor glue+cudagraph": lambda: ours(fresh(), True, "inductor"),
    }
    for variant in variants:
        fn = measure_variant(result, variant, makers[variant], reps, max(1, iters // 4))
        if fn is not None and profile and variant in ("fusion_compiler fp16+cudagraph",
                                                      "fusion_compiler fp16+inductor glue+cudagraph",
                                                      "eager fp16+cudagraph"):
            result.setdefault("profiles", {})[variant] = kernel_profile(fn, calls=5)
    return result


def kernel_profile(fn: Callable[[], object], calls: int = 20) -> str:
    """Kernel names, counts and CUDA time for ``calls`` calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def print_table(results: list[dict]) -> str:
    from rich.console import Console
    from rich.table import Table

    tables = []
    for kind, names in (("inference, ms per call", VARIANTS),
                        ("training step, ms per step", TRAIN_VARIANTS)):
        rows = [r for r in results if r.get("train", False) == (names is TRAIN_VARIANTS)]
        variants = [v for v in names if any(v in r["ms"] for r in rows)]
        if not rows:
            continue
        table = Table(title=f"{kind} (median), {torch.cuda.get_device_name()}, "
                            f"torch {torch.__version__}")
        table.add_column("model")
        for v in variants:
            table.add_column(v, justify="right")
        for r in rows:
            params = ", params channels_last" if r.get("channels_last") else ""
            table.add_row(f"{r['model']} {'x'.join(map(str, r['input']))}{params}",
                          *("-" if r["ms"].get(v) is None else f"{r['ms'][v]:.3f}"
                            for v in variants))
        tables.append(table)
    comp = Table(title="compile time, s (first call included)")
    comp.add_column("model")
    names = sorted({k for r in results for k in r["compile_s"]})
    for k in names:
        comp.add_column(k, justify="right")
    for r in results:
        comp.add_row(r["model"], *(f"{r['compile_s'][k]:.1f}" if k in r["compile_s"] else "-"
                                   for k in names))
    console = Console(width=200)
    with console.capture() as cap:
        for table in tables:
            console.print(table)
        console.print(comp)
        for r in results:
            for variant, err in r.get("rel_err_vs_fp32", {}).items():
                console.print(f"{r['model']}: {variant} max rel. error vs fp32 {err:.2e}")
            if "defaults" in r:
                console.print(f"{r['model']}: compile(model) took {r['defaults']}")
            for variant, msg in r.get("errors", {}).items():
                console.print(f"{r['model']}: {variant} failed: {msg}")
    text = cap.get()
    print(text)
    return text


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = [v for v in (*VARIANTS, *TRAIN_VARIANTS) if r["ms"].get(v) is not None]
        ax.barh(names, [r["ms"][v] for v in names],
                color=["tab:green" if v.startswith("fusion") else "tab:gray" for v in names])
        ax.set_xlabel("ms per training step (median)" if r.get("train") else "ms per call (median)")
        ax.set_title(f"{r['model']} {'x'.join(map(str, r['input']))}")
        ax.invert_yaxis()
    fig.suptitle(f"fusion_compiler, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compile_only(args: argparse.Namespace) -> float:
    """Seconds from before the compile (``import fusion_compiler`` included) to the first output
    of ``args.variant`` on ``args.compile_only``, in this (new) process."""
    model = build_model(args.compile_only, args.channels_last)
    x = torch.randn(MODELS[args.compile_only][1], device="cuda", dtype=torch.half)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if args.variant.startswith("torch.compile"):
        module = torch.compile(model, mode="reduce-overhead")
    else:
        import fusion_compiler  # noqa: PLC0415  (timed: part of the first output's cost)

        module = fusion_compiler.compile(model, cache_dir=args.cache_dir,
                                         **tuned(args.autotune), **OPTIONS[args.variant])
    with torch.inference_mode():
        module(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--variants", default=None,
                        help="comma-separated (default: all): " + ", ".join(VARIANTS) +
                             "; training: " + ", ".join(TRAIN_VARIANTS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    parser.add_argument("--profile", action="store_true",
                        help="kernel profiles of the CUDA-graph variants (fusion_compiler; "
                             "for training also eager)")
    parser.add_argument("--autotune", type=int, default=None,
                        help="cuDNN plans timed per region (default: compile()'s)")
    parser.add_argument("--channels-last", action="store_true",
                        help="store every variant's parameters channels_last "
                             "(model.to(memory_format=torch.channels_last)); inputs stay NCHW")
    parser.add_argument("--compile-only", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(1, "benchmark.py needs a CUDA GPU\n")
    if args.compile_only:
        print(compile_only(args))
        return 0
    models = args.models.split(",")
    if len(models) > 1:  # one process per model (see own_process)
        results = [own_process(m, args) for m in models]
    elif models[0].endswith("-train"):
        variants = args.variants.split(",") if args.variants else TRAIN_VARIANTS
        results = [bench_training(models[0], variants, args.reps, args.iters, args.autotune,
                                  args.profile, args.channels_last)]
    else:
        variants = args.variants.split(",") if args.variants else VARIANTS
        results = [bench_model(models[0], variants, args.reps, args.iters, args.profile,
                               args.autotune, args.channels_last)]
    if args.result_json:
        args.result_json.write_text(json.dumps(results[0]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    text = print_table(results)
    for r in results:
        if "tuning" in r:
            print(f"{r['model']}:\n{r['tuning']}")
        for variant, prof in r.get("profiles", {}).items():
            calls = "5 steps" if r.get("train") else "20 calls"
            print(f"kernel profile, {r['model']}, {variant}, {calls}:\n{prof}")
        if "gradients" in r:
            print(f"{r['model']}, backward pieces per region:\n{r['gradients']}")
    (args.out / "bench.txt").write_text(text)
    (args.out / "bench.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, indent=1))
    plot(results, args.out / "bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
