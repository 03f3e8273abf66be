"""The README's Python blocks run as written (each in a fresh process, as a user would paste it), and
its set-up commands are the ones CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _title(block: str) -> str:
    """The README heading above `block` (the test's id)."""
    before = README[: README.index(block)]
    return re.findall(r"^#+ (.+)$", before, flags=re.M)[-1]


def test_the_readme_has_its_recipes():
    titles = [_title(b) for b in BLOCKS]
    for recipe in ("Quick start", "Training with the HuggingFace `Trainer`", "Generation", "Sentence embeddings",
                   "What was fused, and how many bytes it saved", "Options"):
        assert recipe in titles, titles


@pytest.mark.parametrize("block", BLOCKS, ids=[re.sub(r"\W+", "_", _title(b)).strip("_") for b in BLOCKS])
def test_readme_block_runs_as_written(block, tmp_path):
    if "Trainer" in block:
        pytest.importorskip("accelerate")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(block)], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, f"README block under {_title(block)!r} failed:\n{r.stderr[-4000:]}"
    # dmfx fused something in every block that compiles (a block must show dmfx at work, not a fallback)
    assert "left to PyTorch (" not in r.stdout, r.stdout


def test_the_readme_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[models]" && python -m dmfx demo' in README
    assert 'pip install -e ".[test]" && python -m pytest -n 2 --dist loadfile' in README
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest -q -n 2 --dist loadfile" in ci and "ruff check ." in ci
