"""README.md is a user's page that holds: its set-up commands are exactly what CI runs, its Use
snippet runs as written (on the CPU here; on a GPU machine the same test takes the CUDA path), its
links lead to files of the repository, and it stays short."""

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _block(after: str, language: str) -> str:
    return README.split(after, 1)[1].split(f"```{language}", 1)[1].split("```", 1)[0]


def test_ci_runs_the_readme_commands():
    commands = [line for line in _block("## Set up and run", "bash").strip().splitlines()
                if line.strip()]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    for command in commands:
        assert command in ci


def test_the_use_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    snippet = tmp_path / "use.py"
    snippet.write_text(_block("## Use", "python"))
    monkeypatch.setenv("FUSION_COMPILER_CACHE_DIR", str(tmp_path / "plans"))
    scope = runpy.run_path(str(snippet))
    printed = capsys.readouterr().out
    assert "fused regions" in printed and "check passed" in printed
    assert scope["y"].shape == (8, 32, 64, 64)


def test_the_readme_links_exist_and_it_stays_short():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and all((ROOT / link).exists() for link in links if "://" not in link)
    assert len(README.splitlines()) <= 120
