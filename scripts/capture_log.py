"""A pytest plugin for the GPU suite (``-p capture_log``, with ``scripts/`` on ``sys.path``;
:mod:`gpu_suite` loads it): every CUDA graph capture's begin and end through PyTorch's API
(``torch.cuda.CUDAGraph.capture_begin``/``capture_end``, which ``torch.cuda.graph`` and this
package's captures use) is kept in memory with its thread, stream, test and caller; when a test
fails with a CUDA error, the captures still open and the last 60 events, with the names of the
live threads, are appended to the file ``$FUSION_COMPILER_CAPTURE_LOG``. Made to chase a "capturing
blocking stream" error that struck one test in a few hundred (docs/decisions.md, "Plans build in
worker processes while the caller's work runs").

With ``FUSION_COMPILER_CAPTURE_WATCH=1`` two watchers run as well. A Python thread samples every
thread's stack every 2 ms and keeps each change. A C thread (``legacy_watch.c``, built here with
``cc``; skipped without one) asks the CUDA driver every ~10 us whether the legacy stream would join
a capture: ``cuStreamIsCapturing`` on it returns ``CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`` while any
blocking stream of the context is capturing, whatever API began the capture. It needs no GIL,
which matters: the cuDNN frontend's Python calls (plan building, deserialization, execution) hold
the GIL, so no Python thread runs while they do. A failure prints the last 3 s of stack changes
and such answers in time order; the end of the session appends how many answers were yes, and in
which tests."""

from __future__ import annotations

import collections
import ctypes
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch

_EVENTS: collections.deque = collections.deque(maxlen=400)
_OPEN: dict[int, tuple] = {}
_TEST = ["?"]


def _event(kind: str, caller: str = "") -> tuple:
    return (time.monotonic(), threading.current_thread().name, kind,
            torch.cuda.current_stream().cuda_stream, _TEST[0], caller)


def _patch() -> None:
    cls = torch.cuda.CUDAGraph
    begin, end = cls.capture_begin, cls.capture_end

    def capture_begin(self, *args, **kwargs):
        frames = traceback.extract_stack(limit=7)[:-1]
        entry = _event("begin", " < ".join(f"{f.name}:{f.lineno}" for f in reversed(frames)))
        _EVENTS.append(entry)
        _OPEN[id(self)] = entry
        return begin(self, *args, **kwargs)

    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            _OPEN.pop(id(self), None)
            _EVENTS.append(_event("end"))

    cls.capture_begin, cls.capture_end = capture_begin, capture_end


_STACKS: collections.deque = collections.deque(maxlen=20000)


def _stack(frame, depth: int = 12) -> tuple:
    names = []
    while frame is not None and len(names) < depth:
        names.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(names)


def _watch() -> None:
    """Sample every thread's stack every 2 ms; keep each change."""
    me, names, last = threading.get_ident(), {}, {}
    while True:
        time.sleep(0.002)
        now = time.monotonic()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            stack = _stack(frame)
            if last.get(ident) != stack:
                last[ident] = stack
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                _STACKS.append((now, names.get(ident, str(ident)), stack))


_C: list = []  # the C watcher's library, once started
_STARTS: list[tuple[float, str]] = []  # (monotonic time, test) of every test's start


def build_watcher() -> ctypes.CDLL:
    """``legacy_watch.c`` built with ``cc`` into a temporary folder and loaded (not started).

    Raises:
        OSError, subprocess.SubprocessError: no ``cc``, or the build or load failed."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "legacy_watch.c")
    library = os.path.join(tempfile.mkdtemp(prefix="legacy_watch"), "legacy_watch.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source, "-ldl",
                    "-lpthread"], check=True, capture_output=True, timeout=60)
    return ctypes.CDLL(library)


def _c_watcher(path: str):
    """Build and start ``legacy_watch.c``; ``None`` (said in the log) where that fails."""
    try:
        lib = build_watcher()
        torch.ones(1, device="cuda")  # the primary context exists before the watcher takes it
        if lib.watch_start(torch.cuda.current_device()) != 0:
            raise OSError("pthread_create failed")
    except (OSError, subprocess.SubprocessError) as error:
        with open(path, "a") as out:
            print(f"capture_log: no C watcher ({error!s:.200})", file=out)
        return None
    return lib


def _c_hits() -> tuple[list[int], list[float]]:
    """The C watcher's counts (polls, yes, other errors, last other error) and yes times."""
    counts, times = (ctypes.c_long * 4)(), (ctypes.c_double * 256)()
    _C[0].watch_read(counts, times)
    return list(counts), list(times)[:min(counts[1], 256)]


def _test_at(when: float) -> str:
    tests = [name for start, name in _STARTS if start <= when]
    return tests[-1] if tests else "?"


def pytest_configure(config) -> None:
    if torch.cuda.is_available():
        _patch()
        path = os.environ.get("FUSION_COMPILER_CAPTURE_LOG")
        if path and os.environ.get("FUSION_COMPILER_CAPTURE_WATCH") == "1":
            threading.Thread(target=_watch, name="capture_log watcher", daemon=True).start()
            lib = _c_watcher(path)
            if lib is not None:
                _C.append(lib)


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("FUSION_COMPILER_CAPTURE_LOG")
    if not (_C and path):
        return
    (polls, yes, other, last), times = _c_hits()
    with open(path, "a") as out:
        print(f"\n=== C watcher: {polls} polls, {yes} answered that a blocking stream was "
              f"capturing, {other} other errors (last {last})", file=out)
        for when in times:
            print(f"  yes at {when:.6f} during {_test_at(when)}", file=out)


def pytest_runtest_setup(item) -> None:
    _TEST[0] = item.nodeid.split("::")[-1]
    _STARTS.append((time.monotonic(), _TEST[0]))


def pytest_runtest_makereport(item, call) -> None:
    path = os.environ.get("FUSION_COMPILER_CAPTURE_LOG")
    if not path or call.excinfo is None or call.when != "call":
        return
    text = str(call.excinfo.value)
    if not any(word in text for word in ("CUDA", "cuda", "CUDNN", "capturing")):
        return
    now = time.monotonic()
    with open(path, "a") as out:
        print(f"\n=== {item.nodeid} at {time.strftime('%H:%M:%S')}.{int(time.time() % 1 * 1000):03d}:"
              f" {len(_OPEN)} capture(s) open", file=out)
        for entry in _OPEN.values():
            print("OPEN", f"{entry[0] - now:+.3f}s", *entry[1:], file=out)
        for entry in list(_EVENTS)[-60:]:
            print(f"{entry[0] - now:+.3f}s", *entry[1:], file=out)
        print("threads (name, native id as in CUDA's log):",
              [(t.name, t.native_id) for t in threading.enumerate()], file=out)
        recent = [(e[0], e[1], " < ".join(e[2])) for e in list(_STACKS) if e[0] > now - 3.0]
        if _C:
            counts, times = _c_hits()
            print(f"C watcher: {counts[0]} polls, {counts[1]} yes so far", file=out)
            recent += [(t, "C watcher", "a blocking stream is capturing") for t in times
                       if t > now - 3.0]
        for when, thread, what in sorted(recent, key=lambda e: e[0]):
            print(f"{when - now:+.4f}s", thread, what, file=out)
