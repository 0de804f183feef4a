"""Draw the GPU kernels of profiled training steps per stream, one panel per trace: where the
communication kernels (NCCL's, and the spin kernel of ``train_ddp.py --slow-allreduce-us``) ran
beside the backward's kernels.

    python examples/train_ddp.py --variant fusion_compiler,door ... --profile trace/
                                    # (under torchrun) a trace per variant and rank
    python examples/plot_timeline.py trace/fusion_compiler_rank0.json trace/door_rank0.json \\
        --labels "compile(model)" "torch.compile door" --out timeline.png

Each input is a Chrome trace written by ``torch.profiler`` (``export_chrome_trace``). Needs
matplotlib (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(trace: dict) -> list[dict]:
    """The GPU events (kernels, copies, fills) of a Chrome trace that ``torch.profiler`` wrote:
    dicts with ``name``, ``tid`` (the stream), ``ts`` and ``dur`` (µs)."""
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]


def is_communication(name: str) -> bool:
    """Whether a GPU kernel of this name communicates: NCCL's, or the spin kernel that
    ``torch.cuda._sleep`` runs (``train_ddp.py --slow-allreduce-us``'s stand-in for a slow
    link)."""
    name = name.lower()
    return "nccl" in name or "spin" in name


def kernel_spans(trace: dict) -> dict[str, list[tuple[float, float, str]]]:
    """``{stream: [(start µs, duration µs, kind), ...]}`` of a Chrome trace's GPU events,
    times from the first of them; ``kind`` is ``"comm"`` (:func:`is_communication`),
    ``"copy"`` or ``"compute"``."""
    events = gpu_events(trace)
    if not events:
        return {}
    t0 = min(e["ts"] for e in events)
    streams: dict[str, list[tuple[float, float, str]]] = {}
    for e in events:
        kind = ("comm" if is_communication(e["name"]) else
                "copy" if e.get("cat") != "kernel" else "compute")
        streams.setdefault(str(e["tid"]), []).append((e["ts"] - t0, e["dur"], kind))
    return streams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=Path("timeline.png"))
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("plot_timeline: needs matplotlib (pip install -e \".[plot]\")", file=sys.stderr)
        return 2
    labels = args.labels or [str(p) for p in args.traces]
    if len(labels) != len(args.traces):
        print("plot_timeline: give one label per trace", file=sys.stderr)
        return 2
    colors = {"compute": "tab:blue", "copy": "tab:gray", "comm": "tab:red"}
    spans = [kernel_spans(json.loads(p.read_text())) for p in args.traces]
    width = max((s + d for streams in spans for ks in streams.values() for s, d, _ in ks),
                default=1.0) / 1000.0
    fig, axes = plt.subplots(len(spans), 1, figsize=(11, 1.2 + 1.1 * len(spans)),
                             sharex=True, squeeze=False)
    for ax, streams, label in zip(axes[:, 0], spans, labels):
        names = sorted(streams, key=lambda s: -len(streams[s]))  # the compute stream first
        for row, stream in enumerate(names):
            for kind in colors:
                bars = [(s / 1000.0, d / 1000.0) for s, d, k in streams[stream] if k == kind]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[kind])
        ax.set_yticks(range(len(names)), [f"stream {s}" for s in names])
        ax.set_ylim(len(names) - 0.5, -0.5)
        last = max(s + d for ks in streams.values() for s, d, _ in ks) / 1000.0
        ax.set_title(f"{label}: {last:.2f} ms from the first kernel to the last", fontsize=9,
                     loc="left")
    axes[-1, 0].set_xlim(0, width)
    axes[-1, 0].set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["compute kernels", "copies", "communication (NCCL, delay)"],
               loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
