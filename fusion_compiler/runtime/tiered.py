"""Tiered compilation: serve calls from a quick first tier while a faster tier compiles in the
background.

A specialization whose glue is compiled by Inductor would otherwise make its first call wait for
Inductor (on an H100, about 10 s cold and 3.5 s warm for SE-ResNet9, against 1-4 s for everything
else). With tiering, the first tier (the same regions, the glue as eager PyTorch ops, in a CUDA
graph) answers at once, and one background thread compiles the second tier. The first call after
the compile finished switches tiers (capturing the second tier's CUDA graph, tens of ms) and
frees the first tier. The tiers compute the same function; outputs may differ in the last bits
(Inductor's fused glue rounds differently from eager ops).

While the background thread compiles, it holds the GIL in Python's switch-interval slices (5 ms),
so calls in that window can take longer. Its GPU work runs on a stream of its own and never
touches a region's workspace (regions are not executed there, see
:func:`fusion_compiler.runtime.region_op.dry_run`). Captures of this package use
``capture_error_mode="thread_local"``, so the background thread's device synchronizations
(Triton's autotuning) do not invalidate a capture on the calling thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import weakref
from typing import Any, Callable

__all__ = ["TieredRunner", "submit", "drain"]

log = logging.getLogger("fusion_compiler")

_worker_lock = threading.Lock()
_queue: "queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], Any]]] | None" = None


def _work(jobs: "queue.SimpleQueue") -> None:
    while True:
        future, fn = jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)


def submit(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run ``fn()`` on the package's one background compile thread (a daemon: an exiting
    interpreter does not wait for it); jobs run one at a time, in order of submission. Returns
    the future of its result."""
    global _queue
    with _worker_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_work, args=(_queue,), daemon=True,
                             name="fusion_compiler-background-compile").start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    _queue.put((future, fn))
    return future


def drain(timeout: float | None = None) -> bool:
    """Block until every job submitted so far has ended (at most ``timeout`` s); returns whether
    they have. A compile on the calling thread waits for them first: two compiles at once would
    share Dynamo's and Inductor's process-wide configuration."""
    if _queue is None:
        return True
    done, _ = concurrent.futures.wait([submit(lambda: None)], timeout=timeout)
    return bool(done)


class TieredRunner:
    """Calls go to ``first`` until ``build()``, run by :func:`submit`, has finished; the next call
    then switches to ``finish(build())`` and closes ``first``.

    Args:
        first: the first tier's callable (``close()`` is called on it, if it has one, after the
            switch).
        build: the background part of the second tier's compile (runs on the background thread).
        finish: turns ``build``'s result into the second tier's callable, on the calling thread
            (e.g. captures its CUDA graph).
        on_failure: called with a one-line reason when ``build`` or ``finish`` raised; calls then
            stay on ``first``.

    Attributes:
        tier: 1 while calls go to ``first``, 2 after the switch.
    """

    def __init__(self, first: Callable[..., Any], build: Callable[[], Any],
                 finish: Callable[[Any], Callable[..., Any]],
                 on_failure: Callable[[str], None]):
        self.run, self.tier = first, 1
        self._build, self._finish, self._on_failure = build, finish, on_failure
        me = weakref.ref(self)  # a runner dropped before its turn costs no compile
        self._future: concurrent.futures.Future | None = submit(
            lambda: None if (runner := me()) is None or runner._build is None
            else runner._build())

    def __call__(self, *args: Any) -> Any:
        if self._future is not None and self._future.done():
            self._switch()
        return self.run(*args)

    @property
    def pending(self) -> bool:
        """Whether the second tier is still compiling (or compiled, not yet switched to)."""
        return self._future is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background compile ends (at most ``timeout`` s), then switch tiers on
        this thread. Returns ``False`` when the timeout passed first, else ``True`` (also when the
        compile failed: calls then stay on the first tier)."""
        if self._future is None:
            return True
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        if not done:
            return False
        self._switch()
        return True

    def _switch(self) -> None:
        future, self._future = self._future, None
        finish, on_failure = self._finish, self._on_failure
        self._build = self._finish = self._on_failure = None  # their example inputs are freed
        try:
            second = finish(future.result())
        except Exception as exc:  # the compile or the capture failed: stay on the first tier
            on_failure(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
            return
        first, self.run, self.tier = self.run, second, 2
        close = getattr(first, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Drop the pending compile (its result is discarded) and close the current tier."""
        if self._future is not None:
            self._future.cancel()
            self._future = self._build = self._finish = self._on_failure = None
        close = getattr(self.run, "close", None)
        if close is not None:
            close()
