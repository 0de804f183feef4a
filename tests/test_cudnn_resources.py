"""cuDNN handles per thread and workspaces per stream
(:mod:`fusion_compiler.backends.cudnn.resources`), and where plans build beside the caller's work,
on the CPU with stand-ins for the cuDNN calls, streams and worker processes."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import torch

from fusion_compiler.backends.cudnn.resources import STREAMS_KEPT, HandlePool, Workspaces


class _FakeCudnn:
    def __init__(self):
        self.made: list[dict] = []

    def create(self, index: int) -> dict:
        handle = {"device": index, "stream": None}
        self.made.append(handle)
        return handle

    def set_stream(self, handle: dict, stream: int) -> None:
        handle["stream"] = stream


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_asking_for_a_handle_does_not_move_another_threads_handle_to_its_stream():
    """The race this rule removes: the background thread (loading a plan) asked for the one
    handle of the device between the calling thread's set_stream and its execute, and the
    calling thread's plan then ran on the background thread's stream."""
    cudnn = _FakeCudnn()
    pool = HandlePool(cudnn.create, cudnn.set_stream)
    mine = pool.get(0, stream=111)  # the calling thread: about to execute on stream 111
    theirs = _in_thread(lambda: pool.get(0, stream=0))  # another thread, legacy stream
    assert theirs is not mine
    assert mine["stream"] == 111
    assert pool.get(0, stream=111) is mine  # a thread keeps its handle
    assert pool.get(1, stream=5) is not mine and len(cudnn.made) == 3  # and one per device


def test_the_handles_of_a_thread_that_ended_serve_the_next_thread():
    cudnn = _FakeCudnn()
    pool = HandlePool(cudnn.create, cudnn.set_stream)
    first = _in_thread(lambda: pool.get(0, stream=7))
    gc.collect()
    second = _in_thread(lambda: pool.get(0, stream=9))
    assert second is first and second["stream"] == 9
    assert len(cudnn.made) == 1


def test_workspaces_are_per_stream_and_only_the_streams_used_last_keep_theirs():
    spaces = Workspaces()
    cpu = torch.device("cpu", 0)
    default = spaces.get(cpu, 0, 64, False)
    side = spaces.get(cpu, 1, 64, False)
    assert side is not default  # two streams never share scratch
    assert spaces.get(cpu, 0, 32, False) is default  # large enough: reused
    others = [weakref.ref(spaces.get(cpu, s, 16, False)) for s in range(2, 2 + STREAMS_KEPT)]
    gc.collect()
    assert spaces.get(cpu, 0, 1, False) is not default  # stream 0 was used longest ago: freed, new
    assert all(ref() is not None for ref in others[-(STREAMS_KEPT - 1):])


def test_a_captured_streams_workspace_is_never_freed():
    spaces = Workspaces()
    cpu = torch.device("cpu", 0)
    captured = weakref.ref(spaces.get(cpu, 42, 64, capturing=True))
    for s in range(STREAMS_KEPT + 2):  # other streams come and go
        spaces.get(cpu, s, 16, False)
    spaces.get(cpu, 42, 1024, False)  # grown: the captured one is retired, kept
    gc.collect()
    assert captured() is not None and spaces.retired == [captured()]


def test_on_the_background_thread_plans_build_in_worker_processes(monkeypatch):
    """cuDNN's plan building in this process, beside the caller's CUDA work, was the one thing
    running when that work failed with a capture error: on the background thread a plan that no
    prefetch started goes to the worker processes; on the calling thread it builds here."""
    from concurrent.futures import Future

    import fusion_compiler.backends.cudnn.backend as backend_module
    from fusion_compiler.backends.cudnn.backend import CudnnBackend
    from fusion_compiler.runtime.background import submit

    submitted, built_here = [], []

    class _Pool:
        def submit(self, job):
            submitted.append(job)
            done = Future()
            done.set_result({"count": 1, "plans": [{"index": 0, "blob": b"plan"}]})
            return done

    monkeypatch.setattr(CudnnBackend, "_pool", staticmethod(lambda device: _Pool()))
    monkeypatch.setattr(backend_module, "build_candidates",
                        lambda job: built_here.append(job) or {"count": 0, "plans": []})
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    backend = CudnnBackend(cache_dir=False, autotune=1)
    recipe, device = {"io": "HALF"}, torch.device("cuda", 0)
    monkeypatch.setattr(backend, "choice_for", lambda recipe, device: None)

    plans, _ = submit(lambda: backend.candidates(recipe, "key", device)).result(10)
    assert len(submitted) == 1 and not built_here and plans[0]["blob"] == b"plan"
    backend.candidates(recipe, "key", device)  # the calling thread
    assert len(submitted) == 1 and len(built_here) == 1


def test_each_capture_owner_gets_workspaces_of_its_own():
    """All of this package's graphs are captured on one stream. Sharing that stream's workspace,
    two runners' graphs replayed at once by two threads on two streams overwrote each other's
    scratch: an owner (a runner's turns) gets its own, grown without freeing what it used, and
    dropped with it."""

    class Owner:  # stands for a runner's Turns
        pass

    spaces = Workspaces()
    cpu = torch.device("cpu", 0)
    a, b = Owner(), Owner()
    first = spaces.get(cpu, 42, 64, capturing=True, owner=a)
    assert spaces.get(cpu, 42, 32, capturing=True, owner=a) is first  # large enough: reused
    other = spaces.get(cpu, 42, 64, capturing=True, owner=b)
    assert other is not first  # the same capture stream, another owner: its own scratch
    assert spaces.get(cpu, 43, 64, capturing=True, owner=a) is not first  # a forked stream
    assert spaces.get(cpu, 42, 64, capturing=True) is not first  # a capture of the caller's
    grown = spaces.get(cpu, 42, 100, capturing=True, owner=a)
    assert grown is not first and grown.numel() == 128  # at least twice the size
    kept = weakref.ref(first)
    del first
    gc.collect()
    assert kept() is not None  # a's kernels captured before still use it
    del a, grown
    gc.collect()
    assert kept() is None  # dropped with its owner
    shared = spaces.get(cpu, 42, 64, capturing=True, owner=(1, 2))  # no weak reference:
    assert shared is spaces.get(cpu, 42, 64, capturing=True)  # the stream's


def test_the_capture_owner_is_seen_by_threads_on_a_stream_of_the_capture(monkeypatch):
    """A training step's backward is captured by autograd's device thread, on the capture
    stream: it must see the capture's owner there (else its plans shared the stream's
    workspace), and no thread may see it on other streams or after the capture."""
    from fusion_compiler.runtime import tensors

    current = threading.local()
    monkeypatch.setattr(tensors, "_raw_stream", lambda: getattr(current, "stream", 7))
    owner, seen = object(), {}

    def other_thread(stream: int) -> None:
        current.stream = stream
        seen[stream] = tensors.capture_owner()

    assert tensors.capture_owner() is None
    with tensors.owning_capture(owner):  # entered on the capture stream, 7
        current.stream = 9  # the capturing thread on a forked stream: registered by its use
        assert tensors.capture_owner() is owner
        current.stream = 7
        for stream in (7, 9, 11):
            t = threading.Thread(target=other_thread, args=(stream,))
            t.start()
            t.join()
    assert seen == {7: owner, 9: owner, 11: None}
    assert tensors.capture_owner() is None
    other_thread(7)
    assert seen[7] is None  # forgotten after the capture
