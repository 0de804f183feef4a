"""The order of this package's CUDA-graph replays (``runtime/replays.py``): replays of one lane
(graphs captured on one stream, which share its GEMM scratch) one after another on the GPU,
replays of two lanes at once, and a graph that draws random numbers (or is not known not to)
alone. CPU: streams, events and the generator's offset are fakes that log what is queued."""

import types

import pytest
import torch

from fusion_compiler.runtime import replays


class _Event:
    count = 0

    def __init__(self):
        _Event.count += 1
        self.id = _Event.count

    def record(self, stream):
        stream.log.append(("record", stream.name, self.id))


class _Stream:
    def __init__(self, name, log, raw):
        self.name, self.log = name, log
        self.cuda_stream, self.device = raw, types.SimpleNamespace(index=0)
        self.stream_id, self.device_index, self.device_type = raw, 0, 1  # its key

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.id))


@pytest.fixture
def fake_cuda(monkeypatch):
    """``(log, current, offset)``: what streams queued, the current stream (a one-element list),
    the default generator's offset (a one-element list the fake graphs move). A fake stream's
    key is ``(raw, 0, 1)``: odd raw ids are PyTorch's own streams, as PyTorch encodes them."""
    log, offset = [], [0]
    current = [_Stream("caller", log, 1)]
    _Event.count = 0
    monkeypatch.setattr(replays, "_REPLAYS", {})
    monkeypatch.setattr(replays, "_offset", lambda index: offset[0])
    monkeypatch.setattr(replays, "_current_stream",
                        lambda index: ((current[0].cuda_stream, 0, 1), current[0]))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return log, current, offset


def _replay(turn, log, name, draws=0, offset=None):
    with turn.replaying():
        log.append(("replay", name))
        if draws:
            offset[0] += draws


def test_replays_of_one_lane_wait_for_each_other_whatever_the_stream(fake_cuda):
    """Two graphs captured on one stream: the second's replay, issued on another stream, waits
    for the event the first recorded (PyTorch's cuBLAS workspace is one per handle and stream,
    so the two graphs share GEMM scratch)."""
    log, current, _ = fake_cuda
    lane = _Stream("lane", log, 100)
    a, b = replays.GraphTurn(lane), replays.GraphTurn(lane)
    a.random = b.random = False  # known: they draw no random numbers
    _replay(a, log, "a")
    current[0] = _Stream("other", log, 3)
    _replay(b, log, "b")
    assert log == [("replay", "a"), ("record", "caller", 1),
                   ("wait", "other", 1), ("replay", "b"), ("record", "other", 1)]


def test_replays_of_two_lanes_run_at_once(fake_cuda):
    """Graphs captured on two streams (two compiled models) share no scratch: the second's
    replay waits for nothing of the first's."""
    log, current, _ = fake_cuda
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    b = replays.GraphTurn(_Stream("lane b", log, 200))
    a.random = b.random = False
    _replay(a, log, "a")
    current[0] = _Stream("other", log, 3)
    _replay(b, log, "b")
    assert [e for e in log if e[0] == "wait"] == []


def test_a_graph_replays_alone_until_it_is_seen_to_draw_no_random_numbers(fake_cuda):
    """A graph's first replay waits for every lane's last replay (every replay fills the
    generator's seed and offset tensors that a drawing graph reads); its offset did not move, so
    its next replay waits only for its own lane's (and the last replay taken alone)."""
    log, current, _ = fake_cuda
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    a.random = False
    _replay(a, log, "a")  # event 1 (lane a)
    b = replays.GraphTurn(_Stream("lane b", log, 200))
    current[0] = _Stream("other", log, 3)
    _replay(b, log, "b first")  # waits for lane a; records lane b (2) and the alone event (3)
    assert b.random is None  # once not enough: another thread may have reseeded meanwhile
    _replay(b, log, "b second")
    assert b.random is False
    del log[:]
    current[0] = _Stream("third", log, 5)
    _replay(b, log, "b again")
    assert log == [("wait", "third", 2), ("wait", "third", 3), ("replay", "b again"),
                   ("record", "third", 2)]
    assert ("wait", "third", 1) not in log  # lane a's replays may run beside it


def test_a_replay_waits_for_no_event_recorded_on_its_own_stream(fake_cuda):
    """An event recorded on the stream a replay is issued on is behind it already (stream order):
    one thread calling one model replays with no wait at all; a replay on another stream
    waits."""
    log, current, _ = fake_cuda
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    for name in ("first", "second", "third"):  # alone, alone, then known not to draw
        _replay(a, log, name)
    assert a.random is False
    assert [e for e in log if e[0] == "wait"] == []
    del log[:]
    current[0] = _Stream("other", log, 3)
    _replay(a, log, "on another stream")
    assert log == [("wait", "other", 1), ("wait", "other", 2), ("replay", "on another stream"),
                   ("record", "other", 1)]


def test_a_graph_that_draws_random_numbers_always_replays_alone(fake_cuda):
    """A graph whose replay moves the generator's offset keeps replaying alone: after every
    lane's last replay; and a graph of another lane waits for it."""
    log, current, offset = fake_cuda
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    a.random = False
    r = replays.GraphTurn(_Stream("lane r", log, 300))
    caller, other = current[0], _Stream("other", log, 3)
    _replay(a, log, "a")  # lane a: event 1, on the caller's stream
    current[0] = other
    _replay(r, log, "r", draws=4, offset=offset)  # waits for 1; lane r: 2, alone: 3
    assert r.random is True and ("wait", "other", 1) in log
    current[0] = caller
    _replay(a, log, "a again")
    current[0] = other
    _replay(r, log, "r again", draws=4, offset=offset)
    waits_of_a = log[log.index(("replay", "r")) + 3:log.index(("replay", "a again"))]
    assert ("wait", "caller", 3) in waits_of_a  # a waits for the drawing graph
    last = log[log.index(("replay", "a again")):]
    assert ("wait", "other", 1) in last  # r: every lane (its own lane's event is on its stream)
    assert offset[0] == 8


def test_without_cuda_a_turn_does_nothing():
    turn = replays.GraphTurn(None)
    with turn.replaying():
        pass
    assert turn.random is None


def test_a_model_keeps_its_capture_stream_and_two_models_get_two(monkeypatch):
    """``capture_stream(model)``: the same stream for every call with one model (its graphs share
    derived tensors: one lane), another for another model, also for a model that cannot be
    hashed (``__eq__`` without ``__hash__``); forgotten when the model dies."""
    import gc

    made = []

    class Stream:
        def __init__(self, index, priority=0):
            made.append(self)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    Stream.priority_range = staticmethod(lambda: (0, -5))

    class Unhashable(torch.nn.Module):
        def __eq__(self, other):
            return self is other

    a, b, c = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), Unhashable()
    assert replays.capture_stream(a) is replays.capture_stream(a)
    assert replays.capture_stream(b) is not replays.capture_stream(a)
    assert replays.capture_stream(c) is replays.capture_stream(c)
    assert replays.capture_stream() is not replays.capture_stream()  # no owner: a new one
    assert len(made) == 5
    key = id(b)
    del b
    gc.collect()
    assert key not in replays._STREAMS


def test_after_a_failed_capture_older_graphs_are_taken_to_draw(fake_cuda):
    """Where the generator's state was replaced by a copy (``release_rng_capture``'s fallback),
    a graph made before reads the old one, whose offset the check cannot see: it replays alone
    for good."""
    log, _, _ = fake_cuda
    turn = replays.GraphTurn(_Stream("lane", log, 100))
    replays.RELEASES[0] += 1
    _replay(turn, log, "first")
    _replay(turn, log, "second")
    assert turn.random is True


def test_release_after_a_failed_capture_copies_the_state_only_if_a_capture_fails(
        monkeypatch, caplog):
    """``release_rng_capture`` captures one node, keeping the generator's state; only where that
    capture fails too is the state replaced by a copy, counted in ``RELEASES`` and said in one
    WARNING."""
    calls = []

    class Generator:
        def clone_state(self):
            calls.append("clone")
            return "copy"

        def graphsafe_set_state(self, state):
            calls.append(("set", state))

    def capture_one_node(device):
        calls.append(("capture", device))
        if fail:
            raise RuntimeError("CUDA error: capture refused")

    monkeypatch.setattr(torch.cuda, "default_generators", [Generator()], raising=False)
    monkeypatch.setattr(replays, "_capture_one_node", capture_one_node)
    releases = replays.RELEASES[0]
    fail = False
    replays.release_rng_capture(0)
    assert calls == [("capture", 0)] and replays.RELEASES[0] == releases
    fail, calls[:] = True, []
    with caplog.at_level("WARNING", logger="fusion_compiler"):
        replays.release_rng_capture(0)
    assert calls == [("capture", 0), "clone", ("set", "copy")]
    assert replays.RELEASES[0] == releases + 1
    assert any("capture refused" in r.message and "replaced by a copy" in r.message
               for r in caplog.records)


def test_a_capture_waits_for_every_replay_and_every_later_replay_waits_for_it(fake_cuda):
    """``capture_begin`` fills the generator's offset tensor that a replay drawing random numbers
    reads: a capture (``capture_turn``) is ordered like a replay taken alone, after the last
    replay of every lane, and the event after it is one that every later replay waits for."""
    log, current, _ = fake_cuda
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    b = replays.GraphTurn(_Stream("lane b", log, 200))
    a.random = b.random = False
    _replay(a, log, "a")  # event 1 (lane a)
    current[0] = _Stream("other", log, 3)
    _replay(b, log, "b")  # event 2 (lane b)
    capture = _Stream("capture", log, 5)
    with replays.capture_turn(capture):
        log.append(("capture",))
    _replay(a, log, "a again")
    assert log[4:] == [("wait", "capture", 1), ("wait", "capture", 2), ("capture",),
                       ("record", "capture", 3),  # the new "alone" event
                       ("wait", "other", 1), ("wait", "other", 3), ("replay", "a again"),
                       ("record", "other", 1)]


def test_a_capture_that_fails_still_orders_later_replays_and_frees_the_turn(fake_cuda):
    log, current, _ = fake_cuda
    capture = _Stream("capture", log, 5)
    with pytest.raises(RuntimeError, match="capture failed"):
        with replays.capture_turn(capture):
            raise RuntimeError("capture failed")
    assert log == [("record", "capture", 1)]
    assert not replays._replays(0).lock.locked()


def test_a_failed_replay_releases_the_turn_and_records_nothing(fake_cuda):
    log, current, _ = fake_cuda
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    with pytest.raises(RuntimeError, match="replay failed"):
        with a.replaying():
            raise RuntimeError("replay failed")
    assert [e for e in log if e[0] == "record"] == [] and a.random is None
    _replay(a, log, "next")  # the device's turn was given back
    assert ("replay", "next") in log


def test_an_external_stream_is_waited_for_even_when_its_handle_is_the_same(fake_cuda):
    """``cudaStreamPerThread`` (handle 2, an external stream to PyTorch) is another stream in
    each host thread: a replay there waits for the last replay even if it was recorded under the
    same handle."""
    log, current, _ = fake_cuda
    per_thread = _Stream("per-thread", log, 2)
    current[0] = per_thread
    a = replays.GraphTurn(_Stream("lane a", log, 100))
    a.random = False
    _replay(a, log, "thread 1")
    _replay(a, log, "thread 2")
    assert log == [("replay", "thread 1"), ("record", "per-thread", 1),
                   ("wait", "per-thread", 1), ("replay", "thread 2"),
                   ("record", "per-thread", 1)]


def test_a_use_after_another_threads_per_thread_stream_waits_for_the_device(monkeypatch):
    """``StreamOrder``: no thread can name another thread's per-thread stream, so a use after
    one there synchronizes the device; on PyTorch's own streams it waits for the stream."""
    import threading

    from fusion_compiler.runtime.tensors import StreamOrder

    raw, calls = [2], []

    class Stream:
        def __init__(self, raw):
            self.raw = raw

        def wait_stream(self, other):
            calls.append(("wait", self.raw, other.raw))

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: raw[0],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(raw[0]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    order = StreamOrder(torch.device("cuda", 0))
    order.follow()
    order.follow()  # the same thread's per-thread stream: its own order
    assert calls == []
    other = threading.Thread(target=order.follow)
    other.start()
    other.join()
    assert calls == ["sync"]
    raw[0] = 7
    order.follow()  # after the other thread's per-thread stream again
    raw[0] = 9
    order.follow()  # one PyTorch stream after another: a stream wait
    assert calls == ["sync", "sync", ("wait", 9, 7)]


def test_every_capture_of_the_package_takes_its_capture_turn():
    """Each function of the package that begins a CUDA-graph capture (``capture_begin``, or
    ``torch.cuda.graph``) also enters ``capture_turn``: a capture's start fills the generator's
    offset tensor that replays drawing random numbers read (a new capture path without its turn
    brings that race back). (``capturing(turn=False)``, the training backward's capture, is the
    one exception, for the deadlock docs/decisions.md describes.)"""
    import ast
    from pathlib import Path

    package = Path(replays.__file__).resolve().parents[1]
    starts, missing = [], []
    for path in sorted(package.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = [ast.unparse(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)]
            if any(c.endswith(".capture_begin") or c == "torch.cuda.graph" for c in calls):
                starts.append(f"{path.name}:{fn.name}")
                if "capture_turn" not in calls:
                    missing.append(f"{path.name}:{fn.name}")
    assert {"cuda_graph.py:capturing", "timing.py:_captured",
            "replays.py:_capture_one_node"} <= set(starts), starts
    assert missing == [], missing
