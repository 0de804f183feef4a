"""Build cuDNN execution plans in worker processes, several at a time.

Building a plan is CPU work, slow when done one after another in the compiling process (the first
plan of an engine in a process pays for loading it), and the frontend holds the GIL while it
builds, so threads do not overlap builds (measurements: docs/decisions.md, "Plan building in
worker processes"). Processes do: each worker builds the plans it is asked for from a recipe
(:mod:`.recipe`: plain data, no torch) and returns them serialized (``pygraph.serialize``); the
compiling process deserializes and times them. A serialized plan is valid for the same GPU model,
cuDNN and frontend versions (docs/cudnn.md, "Serialization"): the workers run on the same GPU as
their parent.

A worker is this file run as a script by the parent's Python (``python workers.py``): it
imports the standard library, the cuDNN frontend and the recipe module only, so it starts in a
fraction of a second, without torch. Parent and worker exchange length-prefixed pickles of plain
data over the worker's stdin and stdout. The worker sees only its parent's GPU
(``CUDA_VISIBLE_DEVICES`` set to the GPU's UUID).

A job (:func:`build_candidates`) is a dict::

    {"recipe": dict, "mode": "ranked" | "first" | "engine",
     "heuristics": ["A", "FALLBACK"],  # ranked and first
     "indices": [int, ...],            # ranked: which plans of the ranked list to build
     "engine": [engine_id, [[knob, value], ...]]}   # engine: rebuild exactly this plan

``ranked`` builds the listed plans; ``first`` the first plan in ranked order that builds;
``engine`` one plan from an engine and knobs chosen before (for another batch size). The result
is ``{"count": number of ranked plans, "plans": [{"index", "name", "engine", "blob", "build_s",
"workspace", "error"}, ...]}``, or ``{"error": text}`` when cuDNN rejects the whole graph.

Pool size: ``FUSION_COMPILER_BUILD_WORKERS`` (``0`` builds in the compiling process), default one
fewer than the CPU count, at most 8. Workers exit when idle for ``IDLE_SECONDS``; each holds a
CUDA context on the GPU while alive, which takes GPU memory (measurements: docs/decisions.md,
"Plan building in worker processes").
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, BinaryIO

if __package__:
    from .recipe import build_pygraph
else:  # run as a worker script: load the recipe module by path, without the package (torch)
    import importlib.util

    _here = os.path.dirname(os.path.abspath(__file__))
    # this folder holds a module named ``cudnn`` (the backend) that must not shadow the frontend
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    _spec = importlib.util.spec_from_file_location("_fusion_compiler_cudnn_recipe",
                                                   os.path.join(_here, "recipe.py"))
    _recipe = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_recipe)
    build_pygraph = _recipe.build_pygraph

__all__ = ["build_candidates", "PlanWorkers", "workers_for", "ENV_VAR", "IDLE_SECONDS"]

ENV_VAR = "FUSION_COMPILER_BUILD_WORKERS"
_LIBRARY_VAR = "_FUSION_COMPILER_LIBCUDNN"
IDLE_SECONDS = 30.0
_MAX_WORKERS = 8


def _condense(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


_HANDLE: dict[int, Any] = {}  # device index (0 in a worker): handle


def _handle() -> Any:
    """This process's cuDNN handle for building on the current device (created on first use; a
    worker sees one GPU). In the compiling process there is one per device, its stream a side
    stream, never the legacy one, as for deserializing (:meth:`.plan.CudnnPlan._deserialize`)."""
    if not __package__:  # a worker
        if not _HANDLE:
            import cudnn  # noqa: PLC0415

            _HANDLE[0] = cudnn.create_handle()
        return _HANDLE[0]
    import cudnn  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from ...runtime.tensors import side_stream  # noqa: PLC0415

    index = torch.cuda.current_device()
    if index not in _HANDLE:
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=side_stream("cudnn-load").cuda_stream)
        _HANDLE[index] = handle
    return _HANDLE[index]


def build_candidates(job: dict) -> dict:
    """Build the plans ``job`` asks for (see module docstring) and return them serialized.

    Runs in a worker process or, without workers, in the compiling process. Never raises for a
    graph cuDNN rejects: the reason is returned as ``{"error": ...}``.
    """
    import cudnn  # noqa: PLC0415

    try:
        spec = build_pygraph(job["recipe"], _handle())
        graph = spec.graph
        graph.validate()
        graph.build_operation_graph()
        if job["mode"] == "engine":
            engine_id, knobs = job["engine"]
            graph.create_execution_plan(engine_id, {cudnn.knob_type(k): v for k, v in knobs})
        else:
            graph.create_execution_plans([getattr(cudnn.heur_mode, h) for h in job["heuristics"]])
        graph.check_support()
        count = graph.get_execution_plan_count()
    except Exception as exc:  # cudnnGraphNotSupportedError, or a backend error
        return {"error": _condense(f"{type(exc).__name__}: {exc}", 400)}
    if job["mode"] == "ranked":
        indices = [i for i in job["indices"] if i < count]
    else:
        indices = list(range(count))
    plans = []
    for index in indices:
        try:
            name = str(graph.get_plan_name_at_index(index))
        except Exception:  # a delegating entry has no name before it builds
            name = f"plan {index}"
        t0 = time.perf_counter()
        try:
            graph.build_plan_at_index(index)
            engine_id, knobs = graph.get_engine_and_knobs_at_index(index)
            plans.append({"index": index, "name": name, "blob": bytes(graph.serialize(as_bytes=True)),
                          "engine": [int(engine_id), [[int(k), int(v)] for k, v in knobs.items()]],
                          "workspace": int(graph.get_workspace_size_plan_at_index(index)),
                          "build_s": time.perf_counter() - t0, "error": ""})
        except Exception as exc:
            plans.append({"index": index, "name": name, "blob": None, "engine": None,
                          "workspace": 0, "build_s": time.perf_counter() - t0,
                          "error": _condense(f"{type(exc).__name__}: {exc}", 200)})
            continue
        if job["mode"] != "ranked":
            break
    return {"count": count, "plans": plans}


# ---------------------------------------------------------------- wire format
def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the plan-build worker closed its pipe")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the plan-build worker closed its pipe")
    return pickle.loads(data)


def _serve() -> None:
    """Worker main loop: answer each job read from stdin on stdout, until stdin closes. A worker
    that cannot make a cuDNN handle exits at once (its parent then builds in its own process)."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything else printed must not corrupt the channel
    library = os.environ.get(_LIBRARY_VAR)
    if library:  # the libcudnn the parent loaded (torch's), before the frontend looks for one
        import ctypes

        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    try:
        _handle()
    except Exception as exc:
        print(f"fusion_compiler plan worker: no cuDNN handle: {exc}", file=sys.stderr)
        sys.exit(3)
    while True:
        try:
            job = _receive(source)
        except EOFError:
            return
        try:
            result = build_candidates(job)
        except Exception as exc:  # a malformed job: answer, do not die
            result = {"error": _condense(f"{type(exc).__name__}: {exc}", 400)}
        _send(sink, result)


# ---------------------------------------------------------------- the pool (parent side)
class PlanWorkers:
    """``size`` worker processes building plans for the GPU whose UUID is ``gpu_uuid``.

    :meth:`submit` queues a job and returns a ``Future`` of its result; a thread per worker feeds
    it jobs (blocked on the pipe, it holds no GIL). A worker that dies fails its job with
    ``EOFError`` (the caller builds that job itself) and is not replaced; when the last one dies,
    every queued job fails likewise, so no caller waits forever; so does a job submitted after
    :meth:`close` (the idle reaper may close a pool a caller has just taken).

    Args:
        command: the worker's command line (default: this file run by this Python).

    Raises (constructor):
        OSError: a worker process could not be started.
    """

    def __init__(self, gpu_uuid: str, size: int, command: list[str] | None = None):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu_uuid, ENV_VAR: "0",
               "PYTHONUNBUFFERED": "1", _LIBRARY_VAR: _loaded_libcudnn()}
        self._jobs: list[tuple[Future, dict]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._busy = 0
        self._alive = size
        self._answered = 0  # jobs a worker answered
        self._last_used = time.monotonic()
        command = command or [sys.executable, os.path.abspath(__file__)]
        self.procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=env) for _ in range(size)]
        self._threads = [threading.Thread(target=self._feed, args=(p,), daemon=True,
                                          name=f"fusion_compiler plan worker {i}")
                         for i, p in enumerate(self.procs)]
        for t in self._threads:
            t.start()

    def submit(self, job: dict) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:  # shut down (idle) after the caller took the pool: build elsewhere
                future.set_exception(EOFError("the plan-build workers were shut down"))
                return future
            self._jobs.append((future, job))
            self._last_used = time.monotonic()
            self._cond.notify()
        return future

    def _feed(self, proc: subprocess.Popen) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                future, job = self._jobs.pop(0)
                self._busy += 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                _send(proc.stdin, job)
                future.set_result(_receive(proc.stdout))
            except (OSError, EOFError, pickle.PickleError) as exc:
                future.set_exception(EOFError(f"plan-build worker failed: {exc}"))
                with self._cond:
                    self._busy -= 1
                    self._alive -= 1
                    if not self._alive:  # nobody left to build what is queued
                        self._closed = True
                        for queued, _ in self._jobs:
                            queued.set_exception(EOFError("every plan-build worker failed"))
                        self._jobs.clear()
                return
            with self._cond:
                self._busy -= 1
                self._answered += 1
                self._last_used = time.monotonic()

    @property
    def failed_at_start(self) -> bool:
        """Every worker exited before answering a job (one that cannot make a cuDNN handle
        exits at once): :func:`workers_for` starts no pool for that GPU again."""
        return not self._answered and all(p.poll() is not None for p in self.procs)

    @property
    def idle_seconds(self) -> float:
        """Seconds since the last job was submitted or finished (0 while any job is pending)."""
        with self._cond:
            if self._jobs or self._busy:
                return 0.0
            return time.monotonic() - self._last_used

    def close(self) -> None:
        """Stop the workers (pending jobs are cancelled)."""
        with self._cond:
            self._closed = True
            for future, _ in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._cond.notify_all()
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


def _loaded_libcudnn() -> str:
    """Path of the ``libcudnn.so`` this process has loaded (torch's), or ``""``: the workers,
    which do not import torch, load the same library (Linux: read from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libcudnn.so"):
                    return path
    except OSError:
        pass
    return ""


_POOLS: dict[str, PlanWorkers] = {}
_POOLS_LOCK = threading.Lock()
_START_FAILED: dict[str, str] = {}  # GPU UUID: why its workers could not start
_EXITED = "every plan-build worker exited before answering a job"


def pool_size() -> int:
    """Workers to start (``FUSION_COMPILER_BUILD_WORKERS``, else CPUs - 1, at most 8)."""
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip():
        return max(0, int(env))
    return max(0, min(_MAX_WORKERS, (os.cpu_count() or 1) - 1))


def workers_for(gpu_uuid: str) -> PlanWorkers | None:
    """The shared pool for the GPU ``gpu_uuid``, started on first use; ``None`` when the pool size
    is below 2 (then plans build in the compiling process). A pool idle for ``IDLE_SECONDS`` is
    shut down by a watcher thread (its CUDA contexts freed) and a later call starts a new one.

    Raises:
        OSError: the workers could not be started, or all of them exited before answering a
            job; not tried again in this process (each try spawns processes), later calls raise
            the same error at once.
    """
    size = pool_size()
    if size < 2:
        return None
    with _POOLS_LOCK:
        pool = _POOLS.get(gpu_uuid)
        if pool is not None and pool.failed_at_start:
            _START_FAILED[gpu_uuid] = _EXITED
            del _POOLS[gpu_uuid]
        if gpu_uuid in _START_FAILED:
            raise OSError(_START_FAILED[gpu_uuid])
        if pool is None:
            try:
                pool = _POOLS[gpu_uuid] = PlanWorkers(gpu_uuid, size)
            except OSError as exc:
                _START_FAILED[gpu_uuid] = str(exc) or type(exc).__name__
                raise
            threading.Thread(target=_reap, args=(gpu_uuid, pool), daemon=True,
                             name="fusion_compiler plan worker reaper").start()
        return pool


def _reap(gpu_uuid: str, pool: PlanWorkers) -> None:
    while True:
        time.sleep(min(IDLE_SECONDS, 5.0))
        if pool.idle_seconds >= IDLE_SECONDS:
            with _POOLS_LOCK:
                if _POOLS.get(gpu_uuid) is pool:
                    del _POOLS[gpu_uuid]
                if pool.failed_at_start:
                    _START_FAILED[gpu_uuid] = _EXITED
            pool.close()
            return


def shutdown() -> None:
    """Stop every pool (also run at interpreter exit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


if __name__ == "__main__":
    _serve()
else:
    import atexit

    atexit.register(shutdown)
