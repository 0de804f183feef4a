"""Run the GPU test suite (tests marked ``gpu``) in chunks that each fit one command of the GPU
machine (10 minutes), and summarize them in one line.

    python scripts/gpu_suite.py --list                     # the chunks
    python scripts/gpu_suite.py --chunk 2 --out DIR        # run chunk 2, results to DIR
    python scripts/gpu_suite.py --summary DIR              # one line for every chunk in DIR

A chunk is a group of test files (:data:`CHUNKS`, about 6-8 minutes each on an H100); files that
hold ``gpu`` tests and are in no chunk form the last one, so a new GPU test file is never left
out. Each chunk writes ``DIR/chunk-<k>.json``: the commit, the hash of the files that ran (``tree``:
compare with ``git rev-parse --short=12 HEAD^{tree}``), the counts (passed, failed, errors,
skipped), the failing and skipped tests with their reasons, and the wall time. A test failing
with a CUDA error appends the CUDA graph captures open and the last ones made, and the live
threads, to ``DIR/capture-log-chunk-<k>.txt`` (``scripts/capture_log.py``); CUDA itself writes
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
    ["test_gpu_defaults.py", "test_gpu_dynamo.py", "test_gpu_background.py"],
    ["test_gpu_conformance.py"],
    ["test_gpu_triton_conv.py", "test_fuzz.py"],
    ["test_gpu_ddp.py", "test_gpu_door_ddp.py"],
]
"""The chunks, by test file (the order they run in)."""


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
    env = {"CUDA_LOG_FILE": str(out / f"cuda-log-chunk-{k}.txt"),  # CUDA's own error log
           **os.environ, "FUSION_COMPILER_CAPTURE_LOG": str(out / f"capture-log-chunk-{k}.txt"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts"),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p",
                           "no:cacheprovider", "-p", "capture_log", f"--junitxml={xml}", *extra,
                           *(str(TESTS / f) for f in files)], cwd=ROOT, env=env)
    result = {"chunk": k, "files": files, "commit": commit, "tree": tree, "exit": proc.returncode,
              "seconds": round(time.monotonic() - start, 1), **_counts(xml)}
    (out / f"chunk-{k}.json").write_text(json.dumps(result, indent=1))
    return result


def _counts(xml: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [],
              "skips": []}
    if not xml.exists():
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--list", action="store_true", help="print the chunks")
    group.add_argument("--chunk", type=int, help="run this chunk (1-based)")
    group.add_argument("--summary", type=Path, help="summarize the results in this folder")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_out" / "gpu_suite",
                        help="where a chunk writes its result (default: bench_out/gpu_suite)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if args.list:
        for k, files in enumerate(chunks(), 1):
            print(f"chunk {k}: {' '.join(files)}")
        return 0
    if args.summary is not None:
        print(summary(args.summary))
        return 0
    if not 1 <= args.chunk <= len(chunks()):
        parser.error(f"--chunk must be between 1 and {len(chunks())}")
    result = run_chunk(args.chunk, args.out, args.pytest_args)
    print(f"chunk {args.chunk}: {result['passed']} passed, {result['failed']} failed, "
          f"{result['errors']} errors, {result['skipped']} skipped in {result['seconds']} s")
    return 0 if result["failed"] == result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
