"""Run the GPU test suite (tests marked ``gpu``) in chunks that each fit one command of the GPU
machine (10 minutes), and summarize them in one line.

    python scripts/gpu_suite.py --list                     # the chunks
    python scripts/gpu_suite.py --chunk 2 --out DIR        # run chunk 2, results to DIR
    python scripts/gpu_suite.py --summary DIR              # one line for every chunk in DIR
    python scripts/gpu_suite.py --all --out DIR            # every chunk, spread over the GPUs
    python scripts/gpu_suite.py --all --chunks 1,3,7 --out DIR   # some of them
    python scripts/gpu_suite.py --all --per-gpu 3 --budget 570 --out DIR   # one 10-minute command

With ``--all`` the chunks run at once on the machine's GPUs (``--gpus``, default every visible
one), up to ``--per-gpu`` chunks on a GPU at a time (default 1), each chunk a process of its own
with ``CUDA_VISIBLE_DEVICES`` set, in ``--chunks``'s order, else the longest first (times of an
earlier run in DIR, else :data:`SECONDS`); a chunk of multi-GPU tests gets :data:`GPUS_NEEDED`
different GPUs. With ``--budget`` (seconds), a chunk whose expected time no longer fits in what is
left is not started, so that a command's time limit never cuts one off halfway (its result would be
lost); the summary names the chunks not run. Chunks beside each other run 1.3-1.6 times slower than
alone; what fitted one command before is in docs/testing.md. A chunk's output goes to
``DIR/log-chunk-<k>.txt``; a line is printed as each chunk ends, then the summary.

A chunk is a group of test files (:data:`CHUNKS`), some with a pytest ``-k`` selection
(:data:`KEYWORDS`: the conformance suite's two halves are two chunks); files that hold ``gpu``
tests and are in no chunk form the last one, so a new GPU test file is never left out. Each chunk
writes ``DIR/chunk-<k>.json``: the commit, the hash of the files that ran (``tree``: compare with
``git rev-parse --short=12 HEAD^{tree}``), the counts (passed, failed, errors, skipped), the
failing and skipped tests with their reasons, the slowest tests with their seconds, and the wall
time. A test failing with a CUDA error appends the CUDA graph captures open and the last ones
made, and the live threads, to ``DIR/capture-log-chunk-<k>.txt`` (``scripts/capture_log.py``).
With ``FUSION_COMPILER_CAPTURE_WATCH=1`` that plugin's watchers run too, and CUDA itself writes
every failing API call (time, thread id, entry point, reason) to ``DIR/cuda-log-chunk-<k>.txt``
(its ``CUDA_LOG_FILE``, CUDA 12.9 and later; unless the variable is set already)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

CHUNKS: list[list[str]] = [
    ["test_gpu.py"],
    ["test_gpu_se_gate.py", "test_gpu_horizontal.py", "test_gpu_dense_conv.py",
     "test_gpu_exit.py", "test_gpu_space_to_depth.py", "test_gpu_derive.py"],
    ["test_gpu_training.py", "test_gpu_graphed_training.py"],
    ["test_gpu_defaults.py"],
    ["test_gpu_conformance.py"],
    ["test_gpu_triton_conv.py", "test_gpu_depthwise.py", "test_fuzz.py",
     "test_gpu_hopper_conv.py"],
    ["test_gpu_ddp.py", "test_gpu_door_ddp.py", "test_gpu_two_devices.py"],
    ["test_gpu_conformance.py"],
    ["test_gpu_dynamo.py", "test_gpu_background.py"],
]
"""The chunks, by test file (the order they run in)."""

KEYWORDS = {5: "first_calls", 8: "last_tier"}
"""Chunks that run only the tests a pytest ``-k`` expression selects: the conformance suite in
two halves (each pattern and door at the first calls, and at the last tier), which alone took
about 500 s as one process."""

SECONDS = {1: 367, 2: 343, 3: 366, 4: 417, 5: 477, 6: 411, 7: 332, 8: 382, 9: 416}
"""Wall seconds of each chunk beside others, the longer of two runs: an H200 of an H200x4 host,
three chunks a GPU (2026-11-28, session 46), and one H200 with three or six chunks at once
(2026-11-29, session 49): the order of ``--all`` where DIR holds no earlier result."""

BESIDE = 1.1
"""How much slower than :data:`SECONDS` says a chunk may run with more than one chunk a GPU (those
were taken three to a GPU; alone chunks run 1.3-1.6 times faster): what ``--budget`` expects of
each chunk."""

SLOWEST = 10
"""Tests listed with their seconds in a chunk's result (``slowest``): where its time goes."""

GPUS_NEEDED = {"test_gpu_ddp.py": 2, "test_gpu_door_ddp.py": 2, "test_gpu_two_devices.py": 2}
"""Test files that need several GPUs (their chunk gets that many under ``--all``)."""


def gpu_files() -> list[str]:
    """Every test file that holds a test marked ``gpu``."""
    marked = re.compile(r"pytest\.mark\.gpu|pytestmark\s*=\s*pytest\.mark\.gpu")
    return sorted(p.name for p in TESTS.glob("test_*.py") if marked.search(p.read_text()))


def chunks() -> list[list[str]]:
    """:data:`CHUNKS` (files that exist), then one chunk of the GPU test files in none."""
    existing = set(gpu_files()) | {p.name for p in TESTS.glob("test_*.py")}
    planned = [[f for f in chunk if f in existing] for chunk in CHUNKS]
    rest = [f for f in gpu_files() if not any(f in c for c in planned)]
    return [c for c in planned if c] + ([rest] if rest else [])


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return (proc.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def _tree() -> str:
    """The hash of the files that ran, as git would commit them (tracked and untracked, ignored
    files left out), in a throwaway index: equal to ``git rev-parse --short=12 HEAD^{tree}`` of
    the commit with these files, also where the checkout's history is older than its files (the
    GPU machine gets a copy of the working tree whose ``HEAD`` may be an earlier commit)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        added = subprocess.run(["git", "add", "-A"], cwd=ROOT, env=env, capture_output=True)
        proc = subprocess.run(["git", "write-tree"], cwd=ROOT, env=env, capture_output=True,
                              text=True)
    return proc.stdout.strip()[:12] if added.returncode == 0 and proc.stdout.strip() else "unknown"


def run_chunk(k: int, out: Path, extra: list[str]) -> dict:
    """Run chunk ``k`` (1-based) with ``pytest -m gpu``; write and return its result."""
    files = chunks()[k - 1]
    out.mkdir(parents=True, exist_ok=True)
    xml = out / f"chunk-{k}.xml"
    commit, tree = _commit(), _tree()  # before the tests write anything
    start = time.monotonic()
    watch = os.environ.get("FUSION_COMPILER_CAPTURE_WATCH") == "1"
    env = {**({"CUDA_LOG_FILE": str(out / f"cuda-log-chunk-{k}.txt")} if watch else {}),
           **os.environ, "FUSION_COMPILER_CAPTURE_LOG": str(out / f"capture-log-chunk-{k}.txt"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts"),
                                                       os.environ.get("PYTHONPATH")]))}
    select = ["-k", KEYWORDS[k]] if k in KEYWORDS else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                           "no:cacheprovider", "-p", "capture_log", f"--junitxml={xml}", *select,
                           *extra, *(str(TESTS / f) for f in files)], cwd=ROOT, env=env)
    result = {"chunk": k, "files": files, "keyword": KEYWORDS.get(k), "commit": commit,
              "tree": tree, "exit": proc.returncode,
              "seconds": round(time.monotonic() - start, 1), **_counts(xml)}
    (out / f"chunk-{k}.json").write_text(json.dumps(result, indent=1))
    return result


def _counts(xml: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
              "skips": [], "slowest": []}
    if not xml.exists():
        return counts
    times = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        times.append((float(case.get("time") or 0.0), name))
        kinds = {child.tag: child for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
            counts["skips"].append(f"{name}: {kinds['skipped'].get('message', '')}"[:200])
        else:
            counts["passed"] += 1
    counts["slowest"] = [f"{t:.1f} s {name}" for t, name in sorted(times, reverse=True)[:SLOWEST]]
    return counts


def summary(folder: Path) -> str:
    """One line over every ``chunk-*.json`` in ``folder``."""
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("chunk-*.json"))]
    if not results:
        return f"no chunk results in {folder}"
    total = {k: sum(r[k] for r in results) for k in ("passed", "failed", "errors", "skipped")}
    commits = sorted({f"{r['commit']} (tree {r.get('tree', 'unknown')})" for r in results})
    ran = sorted(r["chunk"] for r in results)
    missing = [k for k in range(1, len(chunks()) + 1) if k not in ran]
    line = (f"GPU suite at {', '.join(commits)}: {total['passed']} passed, {total['failed']} "
            f"failed, {total['errors']} errors, {total['skipped']} skipped in "
            f"{sum(r['seconds'] for r in results):.0f} s (chunks {ran} of {len(chunks())}")
    line += f"; not run: {missing})" if missing else ")"
    return line


def run_all(out: Path, gpus: list[str], extra: list[str], only: list[int] | None = None,
            per_gpu: int = 1, budget: float | None = None) -> int:
    """Run every chunk, the longest first, or those in ``only`` in that order, as many at once
    as ``gpus`` allow with ``per_gpu`` chunks on a GPU (a chunk that finds no free GPU waits,
    the next ones may start), none started whose expected seconds (times :data:`BESIDE` with
    ``per_gpu`` above 1) exceed what is left of ``budget``; returns 1 if a test failed."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def expected(k: int) -> float:
        earlier = out / f"chunk-{k}.json"
        if earlier.exists():
            return json.loads(earlier.read_text())["seconds"]
        return SECONDS.get(k, 300)

    pending = list(only) if only else sorted(range(1, len(chunks()) + 1), key=expected,
                                             reverse=True)
    beside = BESIDE if per_gpu > 1 else 1.0
    free, running, failed = list(gpus) * per_gpu, {}, False
    while pending or running:
        for k in list(pending):
            if budget is not None and time.monotonic() - start + beside * expected(k) > budget:
                pending.remove(k)
                print(f"chunk {k}: not started, its {beside * expected(k):.0f} s would not fit "
                      f"the {budget:.0f} s budget", flush=True)
                continue
            take = _slots(free, min(max(GPUS_NEEDED.get(f, 1) for f in chunks()[k - 1]),
                                    len(gpus)))
            if take is None:
                continue
            for gpu in take:
                free.remove(gpu)
            log = open(out / f"log-chunk-{k}.txt", "w")
            proc = subprocess.Popen(
                [sys.executable, __file__, "--chunk", str(k), "--out", str(out), "--", *extra],
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(take)}, stdout=log,
                stderr=subprocess.STDOUT)
            running[proc] = (k, take, log)
            pending.remove(k)
        time.sleep(0.5)
        for proc, (k, take, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                free += take
                del running[proc]
                failed |= proc.returncode != 0
                tail = (out / f"log-chunk-{k}.txt").read_text().strip().splitlines()[-1:]
                print(f"GPU {','.join(take)}: {tail[0] if tail else f'chunk {k}: no output'}",
                      flush=True)
    print(summary(out))
    for k in range(1, len(chunks()) + 1):
        result = out / f"chunk-{k}.json"
        for name in json.loads(result.read_text())["failures"] if result.exists() else []:
            print(f"  chunk {k} failed: {name} (log-chunk-{k}.txt)")
    return int(failed)


def _slots(free: list[str], need: int) -> list[str] | None:
    """``need`` free slots on different GPUs, the GPUs with the most free slots first (the least
    loaded), or ``None`` when fewer GPUs have a free slot."""
    by_load = sorted(set(free), key=lambda g: (-free.count(g), free.index(g)))
    return by_load[:need] if len(by_load) >= need else None


def _visible_gpus() -> list[str]:
    """The GPUs ``--all`` spreads the chunks over by default: those ``CUDA_VISIBLE_DEVICES`` names
    (a chunk's own ``CUDA_VISIBLE_DEVICES`` is a subset of them, so a run restricted to GPU 1
    stays on GPU 1), else every GPU torch sees. As CUDA reads that variable, the names end at the
    first negative or empty one (``-1`` or an empty value hides every GPU: the list is then
    empty)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None:  # set, even empty: CUDA sees only what it names
        named = []
        for g in (g.strip() for g in value.split(",")):
            if not g or g.startswith("-"):
                break
            named.append(g)
        return named
    import torch  # only here: the other modes run without it
    return [str(i) for i in range(torch.cuda.device_count())] or ["0"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--list", action="store_true", help="print the chunks")
    group.add_argument("--chunk", type=int, help="run this chunk (1-based)")
    group.add_argument("--summary", type=Path, help="summarize the results in this folder")
    group.add_argument("--all", action="store_true", help="run every chunk, spread over the GPUs")
    parser.add_argument("--gpus", help="with --all: the GPUs to use, e.g. 0,1 (default: those "
                        "CUDA_VISIBLE_DEVICES names, else all)")
    parser.add_argument("--chunks", help="with --all: only these chunks, in this order "
                        "(default: all, the longest first), e.g. 1,3,7")
    parser.add_argument("--per-gpu", type=int, default=1,
                        help="with --all: chunks run at once on one GPU (default 1)")
    parser.add_argument("--budget", type=float,
                        help="with --all: seconds; a chunk whose expected time would not fit "
                        "in what is left is not started")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "gpu_suite",
                        help="where a chunk writes its result (default: bench_out/gpu_suite)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.list:
        for k, files in enumerate(chunks(), 1):
            select = f" -k {KEYWORDS[k]}" if k in KEYWORDS else ""
            print(f"chunk {k}: {' '.join(files)}{select}")
        return 0
    if args.summary is not None:
        print(summary(args.summary))
        return 0
    if args.all:
        gpus = args.gpus.split(",") if args.gpus else _visible_gpus()
        if not gpus:
            parser.error("no GPU to run on: CUDA_VISIBLE_DEVICES hides them all")
        only = [int(k) for k in args.chunks.split(",")] if args.chunks else None
        if only and not all(1 <= k <= len(chunks()) for k in only):
            parser.error(f"--chunks must be between 1 and {len(chunks())}")
        if args.per_gpu < 1:
            parser.error("--per-gpu must be at least 1")
        return run_all(args.out, gpus, args.pytest_args, only, args.per_gpu, args.budget)
    if not 1 <= args.chunk <= len(chunks()):
        parser.error(f"--chunk must be between 1 and {len(chunks())}")
    result = run_chunk(args.chunk, args.out, args.pytest_args)
    print(f"chunk {args.chunk}: {result['passed']} passed, {result['failed']} failed, "
          f"{result['errors']} errors, {result['skipped']} skipped in {result['seconds']} s")
    return 0 if result["failed"] == result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
