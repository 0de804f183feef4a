"""Formatting for the benchmark: the tables of :func:`~.variants.bench` results (times, compile
times, errors against fp32, where the GPU time goes), the bar plot, the files ``--out`` gets,
and the ``bench`` command's arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from .variants import TRAIN_VARIANTS

__all__ = ["format_time_split", "format_results", "plot", "write", "add_arguments"]


def format_time_split(results: Sequence[dict]) -> str:
    """Where the time of each profiled variant goes, per call: GPU time by kernel category (ms,
    kernel count) and the gaps (median wall time less the kernels' time: launches, waits), or
    the overlap when the kernels' time is the larger (kernels on two streams at once: the
    derivation prologue's side stream); then, a line each, every category's slowest kernel
    (mean us per launch)."""
    lines = []
    for r in results:
        for variant, cats in r.get("kernel_time", {}).items():
            t = r["ms"].get(variant)
            gap = None if t is None else t["median"] - cats["total"]["ms"]
            gaps = ("" if gap is None else f"; gaps {gap:.3f} ms" if gap >= 0
                    else f"; overlap {-gap:.3f} ms")
            parts = ", ".join(f"{name} {c['ms']:.3f} ({c['kernels']:.0f})"
                              for name, c in cats.items() if name != "total")
            lines.append(f"{_row_name(r)}: {variant}: kernels {cats['total']['ms']:.3f} ms in "
                         f"{cats['total']['kernels']:.0f}{gaps}: {parts}")
            lines += [f"    slowest {name}: {c['slowest'][0][:70]} {c['slowest'][1]:.1f} us"
                      for name, c in cats.items() if "slowest" in c]
    return "\n".join(lines)


def format_results(results: Sequence[dict]) -> str:
    """Tables of :func:`bench` results: ms per call (median and quartiles) per variant and model,
    with the device's name; compile seconds; errors against fp32; failures and skips."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=200, force_terminal=False, color_system=None)
    with console.capture() as cap:
        for train in (False, True):
            rows = [r for r in results if r["train"] == train]
            if not rows:
                continue
            variants = list(dict.fromkeys(v for r in rows for v in r["ms"]))
            table = Table(title=f"{'training step (forward + backward)' if train else 'forward'},"
                                f" ms per call: median (q1-q3); {rows[0]['gpu']}, torch "
                                f"{rows[0]['torch']}")
            table.add_column("model")
            for v in variants:
                table.add_column(v, justify="right")
            for r in rows:
                cells = []
                for v in variants:
                    t = r["ms"].get(v)
                    cells.append("-" if t is None else
                                 f"{t['median']:.3f} ({t['q1']:.3f}-{t['q3']:.3f})")
                table.add_row(_row_name(r), *cells)
            console.print(table)
        # one row per measurement, one column per model: the names are long, the figures short
        comp = Table(title="compile time, s: build and first call in this process (for "
                           "fusion_compiler up to the compiled glue); 'cold' and 'warm': first "
                           "output in a new process, empty and filled caches; 'tiered up': until "
                           "the compiled glue replaced the eager glue (compile(tiered=True))")
        comp.add_column("variant")
        for r in results:
            comp.add_column(_row_name(r), justify="right")
        keys = list(dict.fromkeys(k for r in results for k in r["compile_s"]
                                  if not k.endswith((" error", " caches"))))
        for k in keys:
            comp.add_row(k, *("-" if r["compile_s"].get(k) is None
                              else f"{r['compile_s'][k]:.1f}" for r in results))
        console.print(comp)
        for r in results:
            for v, err in r.get("rel_err_vs_fp32", {}).items():
                if err is not None:
                    console.print(f"{_row_name(r)}: {v} max rel. error vs fp32 {err:.2e}")
            if "fusion_compiler" in r:
                console.print(f"{_row_name(r)}: {_what_compile_chose(r['fusion_compiler'])}")
                gflop, t = r["fusion_compiler"].get("conv_gflop"), r["ms"].get(r["first"])
                if gflop and t:
                    console.print(f"{_row_name(r)}: {gflop:.2f} GFLOP of convolutions per "
                                  f"forward, {gflop / t['median']:.3g} TFLOP/s over the whole "
                                  f"{r['first']} forward")
            for k, lookups in r["compile_s"].items():
                if k.endswith(" caches"):
                    console.print(f"{_row_name(r)}: {k.removesuffix(' caches')}: cache lookups "
                                  + "; ".join(f"{cache} " + ", ".join(
                                      f"{n} {outcome}" for outcome, n in counts.items())
                                      for cache, counts in lookups.items()))
            if r.get("host_load"):  # eager and host-bound calls slow down on a busy host
                console.print(f"{_row_name(r)}: host load (1-minute average, "
                              f"{r.get('cpus')} CPUs) as each timing began: " + ", ".join(
                                  f"{v} {x:g}" for v, x in r["host_load"].items()))
            if r.get("gpu_ops"):
                console.print(f"{_row_name(r)}: GPU operations per call: " + ", ".join(
                    f"{v} {n:g}" for v, n in r["gpu_ops"].items()))
        split = format_time_split(results)
        if split:
            console.print("GPU time per call by kernel category, ms (kernels):")
            console.print(split)
        for r in results:
            for v, msg in {**r.get("errors", {}), **{k: v for k, v in r["compile_s"].items()
                                                     if k.endswith(" error")}}.items():
                console.print(f"{_row_name(r)}: {v} failed: {msg}")
            for v, why in r.get("skipped", {}).items():
                console.print(f"{_row_name(r)}: {v} skipped: {why}")
    return cap.get()


def _what_compile_chose(chosen: dict) -> str:
    """What ``compile(model)`` chose, in words: regions per backend, the glue, the CUDA graph,
    why a default was not taken."""
    regions = ", ".join(f"{n} on {b}" for b, n in sorted(chosen.get("regions", {}).items()))
    glue = f"glue compiled by {chosen['glue']}" if chosen.get("glue") else "glue as eager ops"
    graph = "one CUDA graph" if chosen.get("cuda_graph") else "no CUDA graph"
    notes = "; ".join(chosen.get("notes") or []) or "none"
    return (f"compile(model) chose: regions {regions or 'none'}; {glue}; {graph}; defaults not "
            f"taken: {notes}")


def _row_name(r: dict) -> str:
    shapes = ", ".join("x".join(map(str, s)) for s in r["inputs"])
    return f"{r.get('label', r['model'])} {shapes} {r['dtype']}"


def plot(results: Sequence[dict], path: Path) -> bool:
    """Bar plot of the medians (one panel per result) to ``path``; ``False`` (nothing written)
    when matplotlib is not installed (``pip install fusion_compiler[plot]``)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = [v for v, t in r["ms"].items() if t is not None]
        medians = [r["ms"][v]["median"] for v in names]
        errors = [[m - r["ms"][v]["q1"] for v, m in zip(names, medians)],
                  [r["ms"][v]["q3"] - m for v, m in zip(names, medians)]]
        ax.barh(names, medians, xerr=errors,
                color=["tab:green" if v.startswith("fusion") else "tab:gray" for v in names])
        ax.set_xlabel("ms per step (median)" if r["train"] else "ms per call (median)")
        ax.set_title(_row_name(r), fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(f"fusion_compiler bench, {results[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(results: Sequence[dict], out: Path) -> list[Path]:
    """``bench.json``, ``bench.txt`` and (with matplotlib) ``bench.png`` in ``out``; returns the
    paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.txt"]
    written[0].write_text(json.dumps({"results": list(results)}, indent=1))
    written[1].write_text(format_results(results))
    if plot(results, out / "bench.png"):
        written.append(out / "bench.png")
    return written


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's own arguments (the model, inputs and compile options are the
    CLI's common ones)."""
    parser.add_argument("--variants", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help="comma-separated (default: all): " + ", ".join(TRAIN_VARIANTS))
    parser.add_argument("--reps", type=positive_int, default=None, help="timed repetitions "
                        "(default 15 on CUDA, 5 on the CPU)")
    parser.add_argument("--iters", type=positive_int, default=None,
                        help="calls per repetition (default: what fills 20 ms)")
    parser.add_argument("--channels-last", action="store_true",
                        help="store the parameters channels_last (inputs stay NCHW)")
    parser.add_argument("--no-compile-times", action="store_true",
                        help="skip the cold and warm compile times in new processes")
    parser.add_argument("--profile", action="store_true",
                        help="print the kernels of 20 calls of the CUDA-graph variants")
