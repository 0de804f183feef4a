"""A pytest plugin for the GPU suite (``-p capture_log``, with ``scripts/`` on ``sys.path``;
:mod:`gpu_suite` loads it): every CUDA graph capture's begin and end through PyTorch's API
(``torch.cuda.CUDAGraph.capture_begin``/``capture_end``, which ``torch.cuda.graph`` and this
package's captures use) is kept in memory with its thread, stream, test and caller; when a test
fails with a CUDA error, the captures still open and the last 60 events, with the names of the
live threads, are appended to the file ``$FUSION_COMPILER_CAPTURE_LOG``. Made to chase a "capturing
blocking stream" error that struck one test in a few hundred (docs/decisions.md, "Plans build in
worker processes while the caller's work runs").

With ``FUSION_COMPILER_CAPTURE_WATCH=1`` a watcher thread also asks CUDA every 2 ms whether the
legacy stream would join a capture (``cudaStreamIsCapturing`` on it fails with
``cudaErrorStreamCaptureImplicit`` while any blocking stream of the device is capturing, whatever
API began the capture), and keeps what every thread was doing when its stack last changed; each
time the answer is yes, every thread's stack is appended to the log at once."""

from __future__ import annotations

import collections
import os
import sys
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


def _watch(path: str) -> None:
    """Sample every thread's stack and ask CUDA whether a blocking stream is capturing."""
    me, names, last = threading.get_ident(), {}, {}
    seen_at = 0.0
    while True:
        time.sleep(0.002)
        now = time.monotonic()
        frames = sys._current_frames()
        for ident, frame in frames.items():
            if ident == me:
                continue
            stack = _stack(frame)
            if last.get(ident) != stack:
                last[ident] = stack
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                _STACKS.append((now, names.get(ident, str(ident)), stack))
        try:
            torch.cuda.is_current_stream_capturing()  # on this thread's legacy stream
        except Exception as error:  # noqa: BLE001 - any error is what we look for
            if now - seen_at > 0.05:
                seen_at = now
                names = {t.ident: t.name for t in threading.enumerate()}
                with open(path, "a") as out:
                    print(f"\n=== WATCH {time.time():.3f} during {_TEST[0]}: {error!s:.120}",
                          file=out)
                    for ident, frame in frames.items():
                        print(f"--- {names.get(ident, ident)}:",
                              " < ".join(_stack(frame, 40)), file=out)


def pytest_configure(config) -> None:
    if torch.cuda.is_available():
        _patch()
        path = os.environ.get("FUSION_COMPILER_CAPTURE_LOG")
        if path and os.environ.get("FUSION_COMPILER_CAPTURE_WATCH") == "1":
            threading.Thread(target=_watch, args=(path,), name="capture_log watcher",
                             daemon=True).start()


def pytest_runtest_setup(item) -> None:
    _TEST[0] = item.nodeid.split("::")[-1]


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
        for entry in [e for e in list(_STACKS) if e[0] > now - 3.0]:
            print(f"{entry[0] - now:+.4f}s", entry[1], " < ".join(entry[2]), file=out)
