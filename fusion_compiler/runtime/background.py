"""The package's background work: one daemon thread, the lock that keeps it apart from the calling
thread's compiles and captures, and the rule for what may run on it.

**The rule.** A job on the background thread touches no process-global state. Tracing does:
``torch.fx`` keeps a process-wide "tracing" flag while it traces (``make_fx``, so AOTAutograd and
Inductor's compile, set it too), and a ``torch.compile``'d function called on any thread while it
is set raises "Detected that you are using FX to symbolically trace a dynamo-optimized function";
``torch.fx.traceback`` keeps its node-metadata state in module globals; Dynamo, Inductor and
functorch read their configuration (``config.patch``) from module globals. So the background
thread builds and loads cuDNN plans (in worker processes, or by deserializing them), lowers
regions and rewrites graphs that are already traced (no tracer runs), and computes Triton's cache
key; every trace, every Inductor or Dynamo compile and every configuration patch runs on the
calling thread (what Inductor does itself: trace and lower on the calling thread, compile
kernels in worker processes). :func:`on_calling_thread` enforces it where this package traces.

**The lock.** :data:`COMPILE_LOCK` is held by a background job from start to end and, on the
calling thread, by every compile of a specialization and every CUDA graph capture of this
package: a capture beside a job that made CUDA calls failed with "operation not permitted when
stream is capturing" (torch 2.11), although captures use ``capture_error_mode="thread_local"``.

**Failures.** A job that fails reports through its future; the tier that waited for it logs one
WARNING per cause (:func:`warn_once`) naming what failed and why, and keeps the tier before it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import queue
import threading
from typing import Any, Callable

__all__ = ["COMPILE_LOCK", "ThreadFlag", "submit", "drain", "on_calling_thread",
           "on_background_thread", "warn_once", "gc_paused"]

log = logging.getLogger("fusion_compiler")

COMPILE_LOCK = threading.RLock()
"""Held by a background job from start to end, and on the calling thread by every compile of a
specialization (capture, passes, lowering with its autotuning) and every CUDA graph capture of
this package (see the module docstring)."""


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (as it was after), for every CUDA graph
    capture of this package. A collection triggered inside a capture runs finalizers on the
    capturing thread: an object of an earlier compile or test freeing CUDA resources
    (a graph, an event, a cuDNN object) then makes CUDA calls a capture forbids; a finalizer
    cannot raise, so the CUDA error they leave behind surfaces at the caller's next checked
    launch. ``torch.cuda.graph`` collects once before its capture begins, not during it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class ThreadFlag:
    """A flag per thread, off until a ``with flag.raised():`` block on that thread (a nested
    block leaves it as the outer one had it); ``bool(flag)`` reads the calling thread's. For
    what a background job does differently from the calling thread: regions not executed
    (:func:`~fusion_compiler.runtime.region_op.dry_run`), no GPU timing
    (:func:`~fusion_compiler.backends.timing.timing_deferred`)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "on", False)

    @contextlib.contextmanager
    def raised(self):
        outer = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = outer


_BACKGROUND = ThreadFlag()
_worker_lock = threading.Lock()
_queue: "queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], Any]]] | None" = None
_warned: set[str] = set()


def _work(jobs: "queue.SimpleQueue") -> None:
    with _BACKGROUND.raised():
        while True:
            future, fn = jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


def submit(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run ``fn()`` on the package's one background thread (a daemon: an exiting interpreter
    does not wait for it); jobs run one at a time, in order of submission. ``fn`` must obey the
    rule of the module docstring. Returns the future of its result."""
    global _queue
    with _worker_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_work, args=(_queue,), daemon=True,
                             name="fusion_compiler-background").start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    _queue.put((future, fn))
    return future


def drain(timeout: float | None = None) -> bool:
    """Block until every job submitted so far has ended (at most ``timeout`` s); returns whether
    they have."""
    if _queue is None:
        return True
    done, _ = concurrent.futures.wait([submit(lambda: None)], timeout=timeout)
    return bool(done)


def on_background_thread() -> bool:
    """Whether the caller runs on the package's background thread (inside a job)."""
    return bool(_BACKGROUND)


def on_calling_thread(what: str) -> None:
    """Raises:
        RuntimeError: called on the background thread (``what`` traces or compiles: the rule of
            the module docstring forbids it there)."""
    if _BACKGROUND:
        raise RuntimeError(f"{what} on fusion_compiler's background thread: tracing and compiling "
                           "touch process-global state and run on the calling thread")


def warn_once(what: str, reason: str) -> None:
    """One WARNING on the ``fusion_compiler`` logger per ``(what, reason)``: ``what`` failed,
    and why (a fallback is never silent)."""
    key = f"{what}: {reason}"
    if key not in _warned:
        _warned.add(key)
        log.warning("%s failed: %s", what, reason)
