"""The GPU suite's runner (``scripts/gpu_suite.py``) on the CPU: which GPUs ``--all`` uses and
that every test file with GPU tests is in a chunk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "gpu_suite.py"


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("gpu_suite", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_all_stays_on_the_gpus_cuda_visible_devices_names(runner, monkeypatch):
    """``CUDA_VISIBLE_DEVICES=1 gpu_suite.py --all`` runs its chunks on GPU 1, not on GPU 0 (a
    chunk's ``CUDA_VISIBLE_DEVICES`` is set from these names)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert runner._visible_gpus() == ["1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert runner._visible_gpus() == ["2", "3"]


def test_all_refuses_when_cuda_visible_devices_hides_every_gpu(runner, monkeypatch, capsys):
    """``CUDA_VISIBLE_DEVICES=-1`` or empty (CUDA's ways to hide every GPU) leaves no GPU:
    ``--all`` says so in one line, and the names end at the first negative one as CUDA reads
    them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")
    assert runner._visible_gpus() == ["0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert runner._visible_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # set and empty: no GPU either
    assert runner._visible_gpus() == []
    with pytest.raises(SystemExit):
        runner.main(["--all"])
    assert "hides them all" in capsys.readouterr().err


def test_every_gpu_test_file_is_in_a_chunk(runner):
    chunked = {f for chunk in runner.chunks() for f in chunk}
    assert set(runner.gpu_files()) <= chunked


def test_a_chunk_result_names_its_slowest_tests(runner, tmp_path):
    """A chunk's result lists its slowest tests from pytest's JUnit XML (chunk 4 took 417 s for
    27 tests in session 44: where that time goes decides how to split the suite)."""
    xml = tmp_path / "chunk-4.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.a" name="fast" time="0.5"/>'
                   '<testcase classname="tests.a" name="slow" time="42.25"/>'
                   '<testcase classname="tests.b" name="skipped" time="0.0"><skipped message="no"/>'
                   '</testcase></testsuite></testsuites>')
    counts = runner._counts(xml)
    assert counts["passed"] == 2 and counts["skipped"] == 1
    assert counts["slowest"][0] == "42.2 s tests.a::slow"
    assert len(counts["slowest"]) == 3


def test_slots_are_on_different_gpus_the_least_loaded_first(runner):
    """``--per-gpu 3`` gives each GPU three slots; a chunk takes the GPU with the most free slots,
    and a two-GPU chunk two different GPUs (never one GPU twice)."""
    free = ["0", "1"] * 3
    assert runner._slots(free, 1) == ["0"]
    assert runner._slots(["0", "1", "1"], 1) == ["1"]
    assert sorted(runner._slots(["0", "1", "1"], 2)) == ["0", "1"]
    assert runner._slots(["1", "1"], 2) is None  # one GPU free: a two-GPU chunk waits


def test_the_conformance_halves_are_chunks_with_a_keyword(runner, tmp_path, monkeypatch):
    """Chunks 5 and 8 run the conformance suite's two halves (``-k first_calls`` and ``-k
    last_tier``); other chunks run their files whole."""
    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(runner.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or Done())
    monkeypatch.setattr(runner, "_commit", lambda: "abc")
    monkeypatch.setattr(runner, "_tree", lambda: "def")
    for k in (5, 8, 1):
        result = runner.run_chunk(k, tmp_path, [])
        assert result["keyword"] == runner.KEYWORDS.get(k)
    assert calls[0][calls[0].index("-k") + 1] == "first_calls"
    assert calls[1][calls[1].index("-k") + 1] == "last_tier"
    assert "-k" not in calls[2]
    assert {k for k, files in enumerate(runner.chunks(), 1)
            if "test_gpu_conformance.py" in files} == {5, 8}


def test_a_budget_starts_no_chunk_that_would_not_fit(runner, tmp_path, monkeypatch, capsys):
    """With ``--budget``, a chunk whose expected seconds exceed what is left is not started (a
    command's time limit would cut it off and lose its result); the summary says so."""
    started = []
    monkeypatch.setattr(runner.subprocess, "Popen", lambda *a, **kw: started.append(a))
    assert runner.run_all(tmp_path, ["0"], [], only=[1, 4], budget=100.0) == 0
    out = capsys.readouterr().out
    assert not started
    assert "chunk 4: not started" in out and "chunk 1: not started" in out


def test_chunks_named_run_in_the_order_given(runner, tmp_path, monkeypatch):
    """``--chunks 1,4``: chunk 1 first (the caller's priority), not the longest first."""
    started = []

    class Finished:
        returncode = 0

        def poll(self):
            return 0

    def popen(cmd, **kwargs):
        started.append(int(cmd[cmd.index("--chunk") + 1]))
        return Finished()

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    assert runner.run_all(tmp_path, ["0"], [], only=[1, 4]) == 0
    assert started == [1, 4]
