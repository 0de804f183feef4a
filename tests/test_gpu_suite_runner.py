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
