"""Fast checks of the examples' command lines (the real-model runs are in test_main_job.py, marked slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "model, expected",
    [
        ("google/gemma-3-270m", "Gemma 3 270M is embedded: omit the model argument"),
        ("./no/such/checkpoint", "does not exist"),
        ("README.md", "neither a directory nor a .gguf file"),
    ],
)
def test_generate_example_model_mistakes_are_one_line(model, expected):
    """A Hub id (offline, not cached) or a wrong path: exit status 2 and one line saying what to pass, no traceback."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "examples/generate_gemma3.py", "--model", model],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], run.stderr
    assert "Traceback" not in run.stderr
